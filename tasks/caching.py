"""Running a cached step, and noticing when a cache record points at outputs that are gone."""

from __future__ import annotations

from typing import Any, TypeVar

from prefect import Task

from tasks.launcher import run_logger

R = TypeVar("R")


def run_step(step: Task[..., R], *args: Any, **kwargs: Any) -> tuple[R, bool]:
    """Run a Prefect task; return (result, was_cached).

    Cache keys are content fingerprints, and the outputs live in the cache directory. If someone deleted those
    outputs, the Prefect record would hand back dangling paths, so the step is run again with a refreshed cache.
    """
    state = step(*args, return_state=True, **kwargs)
    result = state.result()
    cached = state.name == "Cached"
    if cached and hasattr(result, "is_complete") and not result.is_complete():
        run_logger().warning("%s: cached outputs are missing on disk; recomputing", step.name)
        state = step.with_options(refresh_cache=True)(*args, return_state=True, **kwargs)
        result, cached = state.result(), False
    return result, cached
