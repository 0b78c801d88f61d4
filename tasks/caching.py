"""Running a pipeline step and telling whether its output came from the store."""

from __future__ import annotations

from typing import Any

from prefect import Task


def run_step(step: Task[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, bool]:
    """Run a step task; return (result, reused).

    Steps reuse verified store entries (tasks/store.py) and then finish in a Completed state named `Cached`, which
    is how the Prefect UI shows them too; this is the one cache layer, so there is nothing to reconcile here.
    """
    state = step(*args, return_state=True, **kwargs)
    return state.result(), state.name == "Cached"
