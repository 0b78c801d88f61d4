"""The step clock: each optimizer step's time and real tokens, and the steady state drawn from them.

The training worker, the seed recipe and the peers' recipes (benchmarks/) all time their steps with it, so their
tokens/s are measured alike: on a GPU each step boundary is a CUDA event on the device's own timeline (on the CPU,
the host's clock), the tokens counted when the model runs them (data/packing.py TokenTally), warm-up and excluded
steps (saves, compilation) left out.
"""

from __future__ import annotations

import statistics
import time

from finetune_flows.data.packing import TokenTally


def device_events():
    """StepClock's marks on a GPU: a CUDA timing event recorded on the current stream; None where there is no GPU."""
    import torch

    if not torch.cuda.is_available():
        return None

    def recorded():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    return recorded


class StepClock:
    """Per-step time and real tokens.

    With `events` (device_events()) each step boundary is an event the GPU reaches after the step's last kernel, and a
    step's time is the GPU's time between two of them: the host is never made to wait for the device at a step
    boundary, which would leave the GPU idle while the host collates the next batch and launches its forward pass.
    A step's time is read once its event has passed (`steps`: those read so far, without waiting; `settle()` waits
    for the rest). Without `events` the host's clock times each step.

    A step during which a checkpoint was saved or the decoder layers compiled is marked, so the steady-state figure
    can leave it out. The collator's tally counts the tokens when `model` runs them.
    """

    def __init__(self, collator: TokenTally, model, events=None):
        self.collator = collator
        collator.count_on(model)
        self.events = events
        self._steps: list[tuple[int, float, int, bool]] = []  # (step, seconds, tokens, excluded)
        self._pending: list[tuple] = []  # (step, start mark, end mark, tokens, excluded) whose end has not passed
        self._mark = None
        self._tokens = 0
        self._excluded = False

    def _now(self):
        return self.events() if self.events is not None else time.perf_counter()

    def start(self) -> None:
        self._mark = self._now()
        self._tokens = self.collator.tokens

    def step_end(self, step: int) -> None:
        mark = self._now()
        if self._mark is not None:
            self._pending.append((step, self._mark, mark, self.collator.tokens - self._tokens, self._excluded))
        self._mark, self._tokens, self._excluded = mark, self.collator.tokens, False
        self._read(wait=False)

    def _read(self, wait: bool) -> None:
        while self._pending:
            step, start, end, tokens, excluded = self._pending[0]
            if self.events is None:
                seconds = end - start
            elif wait or end.query():
                end.synchronize()
                seconds = start.elapsed_time(end) / 1000
            else:
                return
            self._steps.append((step, seconds, tokens, excluded))
            self._pending.pop(0)

    @property
    def steps(self) -> list[tuple[int, float, int, bool]]:
        """The steps read so far (on a GPU the last one or two may still be running)."""
        self._read(wait=False)
        return self._steps

    def settle(self) -> list[tuple[int, float, int, bool]]:
        """Every step ended so far, waiting for the device where a step is still running."""
        self._read(wait=True)
        return self._steps

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
