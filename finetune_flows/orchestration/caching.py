"""Running a pipeline step and telling whether its output came from the store."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from finetune_flows.orchestration.steps import Step


class StepRun(NamedTuple):
    """How a step ran: served from the store or computed, and its wall time (retries included)."""

    cached: bool
    seconds: float


def run_step(step: Step, *args: Any, **kwargs: Any) -> tuple[Any, StepRun]:
    """Run a step task; return (result, how it ran).

    Steps reuse verified store entries (finetune_flows/store/entries.py) and then finish in a Completed state named `Cached`, which
    is how the Prefect UI shows them too; this is the one cache layer, so there is nothing to reconcile here.
    """
    started = time.perf_counter()
    state = step(*args, return_state=True, **kwargs)
    result = state.result()
    return result, StepRun(state.name == "Cached", round(time.perf_counter() - started, 2))
