"""The built-in demo task: support-ticket triage, generated here (no licence questions, no download).

Each ticket mixes a problem phrase (which decides the team) with an urgency cue (which decides the priority);
the answer is `<team>/<priority>`, e.g. `billing/high`. A chat model answers in prose, so the base model scores
near zero on exact match; a short QLoRA run learns both the mapping and the answer format.

Every generated ticket has a different shape (opener, problem, cue, order), so no two tickets are the same even
with their numbers, case and whitespace folded: a held-out ticket is never a copy of a training one.
"""

from __future__ import annotations

import random
from typing import Iterator

from finetune_flows.errors import DataError

SYSTEM = ("Triage the support ticket. Teams: billing, shipping, account, technical. Priorities: low, normal, high. "
          "Reply only team/priority.")
INSTRUCTION = "Ticket: {ticket}"

PROBLEMS = {
    "billing": ["I was charged twice for order {n}", "my invoice {n} shows the wrong amount",
                "I still have not received the refund for order {n}", "my card was billed after I cancelled",
                "the discount code was not applied to my payment", "please send a receipt for invoice {n}"],
    "shipping": ["my package {n} has not arrived yet", "the tracking number {n} does not work",
                 "the parcel came damaged", "I got the wrong item in box {n}",
                 "the courier left my order at the wrong address", "delivery of order {n} is late"],
    "account": ["I cannot log in to my account", "the password reset email never arrives",
                "please change the email on my profile", "my account {n} was locked",
                "I want to delete my account", "two-factor codes are not accepted"],
    "technical": ["the app crashes when I open settings", "the website shows error {n}",
                  "uploads fail with a timeout", "the export button does nothing",
                  "sync stopped working after the update", "the dashboard loads a blank page"],
}
URGENCY = {
    "high": ["This is urgent!", "Please fix it today, it blocks my work.", "I need help immediately.",
             "ASAP please, customers are waiting."],
    "normal": ["Can you look into it?", "Please help.", "Thanks for checking.", "Let me know what to do."],
    "low": ["No rush, whenever you have time.", "Not urgent at all.", "It can wait until next week.",
            "Just letting you know, low priority."],
}
OPENERS = ["Hi,", "Hello team,", "Good morning,", "Hey,", "Dear support,", ""]


# (team, problem, priority, cue, opener, cue first): every distinct ticket shape
SHAPES = [(team, problem, priority, cue, opener, cue_first)
          for team in sorted(PROBLEMS) for problem in PROBLEMS[team]
          for priority in sorted(URGENCY) for cue in URGENCY[priority]
          for opener in OPENERS for cue_first in (False, True)]


def make_example(shape: tuple, rng: random.Random) -> dict[str, str]:
    team, problem, priority, cue, opener, cue_first = shape
    problem = problem.format(n=rng.randint(1000, 99999))
    parts = [opener, cue, problem[0].upper() + problem[1:] + "."] if cue_first else \
        [opener, problem[0].upper() + problem[1:] + ".", cue]
    ticket = " ".join(p for p in parts if p)
    return {"system": SYSTEM, "prompt": INSTRUCTION.format(ticket=ticket), "response": f"{team}/{priority}"}


def ticket_triage(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n tickets of n different shapes (drawn without replacement)."""
    if n > len(SHAPES):
        raise DataError(f"builtin:ticket-triage has {len(SHAPES)} distinct tickets; data.builtin_examples={n} would "
                        "repeat some")
    rng = random.Random(seed)
    return [make_example(shape, rng) for shape in rng.sample(SHAPES, n)]


BUILTIN_DATASETS = {"ticket-triage": ticket_triage}


def corpus_for_tokenizer() -> Iterator[str]:
    """Text for training the generated models' tokenizer: the demo task plus plain English letters/digits."""
    for ex in ticket_triage(3000, seed=123):
        yield ex["system"]
        yield ex["prompt"]
        yield ex["response"]
    yield "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,!?:;/()-_'\""
