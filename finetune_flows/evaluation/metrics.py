"""Generation metrics: how a greedy answer is scored against its reference, and what the scores mean.

- `exact_match`: the answer equals the reference once leading/trailing whitespace is stripped from both;
  case-sensitive (`Billing/high` is not `billing/high`: a task's answer format includes its case).
- `contains`: the stripped reference appears somewhere in the answer, case-sensitive.

Both are reported for base and adapter; `eval.metric` picks the headline. The gap between them separates format
from ability: an answer that contains the reference but is not exactly it knew the answer and said more.
"""

from __future__ import annotations

METRICS = ("exact_match", "contains")


def score_answer(prediction: str, reference: str, metric: str) -> bool:
    p, r = prediction.strip(), reference.strip()
    return p == r if metric == "exact_match" else bool(r) and r in p  # '' is in every answer: no hit


def rates(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Share of answers that score, per metric (empty when there is nothing generated)."""
    pairs = list(zip(predictions, references))
    if not pairs:
        return {}
    return {m: sum(score_answer(p, r, m) for p, r in pairs) / len(pairs) for m in METRICS}


def explain(base: dict[str, float], adapter: dict[str, float], name: str = "base + adapter",
            long_references: int = 0, max_new_tokens: int = 0) -> str:
    """One paragraph on what the base model's score means: format (right answer, other form) vs ability.
    `name`: the fine-tuned model's row (base + adapter, or a merged checkpoint); `long_references`: how many
    references are longer than the `max_new_tokens` an answer may have (those can never score)."""
    if not base:
        return "No generation metrics: the data has no prompts to answer (text format)."
    e, c = base["exact_match"], base["contains"]
    text = (f"Base model: exact match {e:.2f}, contains {c:.2f}. {name[0].upper() + name[1:]}: exact match "
            f"{adapter['exact_match']:.2f}, contains {adapter['contains']:.2f}. ")
    if c - e > 0:
        text += (f"In {c - e:.0%} of the prompts the base model names the right answer without giving exactly it "
                 "(extra words, another layout): that part of its low exact match is format, not ability. ")
    if c < 1:
        text += (f"In {1 - c:.0%} the right answer does not appear in its output at all: that part is ability (or a "
                 "format far enough off that the answer never appears). ")
    if long_references:
        text += (f"{long_references} reference(s) are longer than eval.max_new_tokens={max_new_tokens} tokens: "
                 "their answers are cut before they could match, for every model; raise eval.max_new_tokens. ")
    return text.strip()
