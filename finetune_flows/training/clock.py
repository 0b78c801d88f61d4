"""The step clock: each optimizer step's wall time and real tokens, and the steady state drawn from them.

The training worker, the seed recipe and the peers' recipes (benchmarks/) all time their steps with it, so their
tokens/s are measured alike: the device synchronised at each step boundary, the tokens counted when the model runs
them (data/packing.py TokenTally), warm-up and excluded steps (saves, compilation) left out.
"""

from __future__ import annotations

import statistics
import time

from finetune_flows.data.packing import TokenTally


class StepClock:
    """Per-step wall time and real tokens, with the device synchronised at each step boundary.

    A step during which a checkpoint was saved or the decoder layers compiled is marked, so the steady-state figure
    can leave it out. The collator's tally counts the tokens when `model` runs them.
    """

    def __init__(self, collator: TokenTally, sync, model):
        self.collator = collator
        collator.count_on(model)
        self.sync = sync
        self.steps: list[tuple[int, float, int, bool]] = []  # (step, seconds, tokens, excluded)
        self._t = None
        self._tokens = 0
        self._excluded = False

    def start(self) -> None:
        self.sync()
        self._t = time.perf_counter()
        self._tokens = self.collator.tokens

    def step_end(self, step: int) -> None:
        self.sync()
        now = time.perf_counter()
        if self._t is not None:
            self.steps.append((step, now - self._t, self.collator.tokens - self._tokens, self._excluded))
        self._t, self._tokens, self._excluded = now, self.collator.tokens, False

    def exclude(self) -> None:
        """Called after a step's end for work done before the next one (a save, a compilation): it lands in the
        next step's interval."""
        self._excluded = True

    def callback(self):
        """A TrainerCallback that starts this clock with training and ends a step at each optimizer step (the seed
        and peer recipes' clock; the rank body's progress callback drives it itself)."""
        from transformers import TrainerCallback

        clock = self

        class Clock(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.start()

            def on_step_end(self, args, state, control, **kwargs):
                clock.step_end(state.global_step)

        return Clock()


def steady_state(per_step: list[tuple[int, float, int, bool]], world_tokens_factor: float, warmup: int | None = None,
                 window: int = 5) -> dict[str, float | int | None]:
    """Median and spread of tokens/s over windows of `window` steps after `warmup` (None: a tenth of the steps, at
    least 2), without the excluded steps (saves, compilation)."""
    if warmup is None:
        warmup = max(2, len(per_step) // 10)
    steady = [(s, sec, tok) for s, sec, tok, excluded in per_step if s > warmup and not excluded]
    windows = [steady[i:i + window] for i in range(0, len(steady) - window + 1, window)]
    rates = [sum(t for _, _, t in w) * world_tokens_factor / sum(sec for _, sec, _ in w) for w in windows]
    if not rates:
        return {"tokens_per_second": None, "min": None, "max": None, "windows": 0, "steps": len(steady),
                "none_because": f"{len(steady)} step(s) after the {warmup}-step warm-up (checkpoint and compiling "
                                f"steps left out), fewer than one {window}-step window"}
    return {"tokens_per_second": round(statistics.median(rates), 1), "min": round(min(rates), 1),
            "max": round(max(rates), 1), "windows": len(rates), "steps": len(steady)}


def steady_text(steady: dict) -> str:
    """`steady 6957.3`, or why a run has no steady-state figure."""
    if steady["tokens_per_second"] is None:
        return f"no steady-state figure: {steady['none_because']}"
    return f"steady {steady['tokens_per_second']}"
