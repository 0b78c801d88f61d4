"""A step's cache key as its task declares it, and running a step telling whether its output came from the store."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from finetune_flows.orchestration.steps import Step
from finetune_flows.runtime.lifecycle import raise_if_stopped, watch_stop_signals


@dataclass(frozen=True)
class CacheKey:
    """A step's cache key, declared beside its task (`@step(..., cache_key=CACHE_KEY)` in tasks/<step>.py).

    `key` is the engine function that computes it from the task's arguments, the one the engine names the store
    entry `<cache root>/<kind>/<key>` by; `hashes` says in words what goes in. Every key also holds the versions of
    the step's libraries and engine modules (STEP_LIBRARIES and STEP_CODE in finetune_flows/store/fingerprint.py).
    """

    kind: str
    key: Callable[..., str]
    hashes: tuple[str, ...]

    def __call__(self, *args: Any) -> str:
        return self.key(*args)


class StepRun(NamedTuple):
    """How a step ran: served from the store or computed, and its wall time (retries included)."""

    cached: bool
    seconds: float


def run_step(step: Step, *args: Any, **kwargs: Any) -> tuple[Any, StepRun]:
    """Run a step task; return (result, how it ran).

    Steps reuse verified store entries (finetune_flows/store/entries.py) and then finish in a Completed state named
    `Cached`, as the Prefect UI shows them; this is the one cache layer, so there is nothing to reconcile here.
    While it runs, every SIGTERM/SIGINT is recorded as it arrives, so that one whose exception was lost (raised
    inside an object's finalizer) is raised again where the step waits on its worker: Prefect's runner cancels a
    deployment run with SIGTERM.
    """
    raise_if_stopped()  # a stop whose exception was lost does not start the next step
    started = time.perf_counter()
    with watch_stop_signals():  # a deployment run's process (the CLI watches already): see raise_if_stopped
        state = step(*args, return_state=True, **kwargs)
    result = state.result()
    return result, StepRun(state.name == "Cached", round(time.perf_counter() - started, 2))
