"""`@step(...)`: how every pipeline step's Prefect task is declared (tasks/<step>.py).

The heavy part of a step runs in a worker process that imports the engine (`python -m finetune_flows.models.quantize
job.json`, or `finetune_flows.training.worker` importing `finetune_flows.data.dataset`), never Prefect, whose import
costs each of them seconds of CPU. A step is declared with `@step(...)` and becomes `prefect.task(...)` the first
time the flow calls it or asks it for a Prefect attribute (`.submit`, `.with_options`, `.name`, ...); `.fn` is the
plain function, as on a Prefect task, and `.cache_key` the step's declared cache key (orchestration/caching.py).

The options are Prefect's, with this project's defaults: no result persistence and no Prefect cache policy (nothing
pickled is ever read back; steps reuse their own verified store entries, finetune_flows/store/entries.py). A
`task_run_name` template never yields square brackets: Prefect's CLI (`prefect deployment run --watch`) prints run
names as rich markup, where `[/abs/path]` is a closing tag and ends the watch with a MarkupError.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable


class Step:
    """A pipeline step: its plain function (`.fn`) and, built on first use, its Prefect task."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.cache_key = options.pop("cache_key", None)  # a CacheKey, for steps that write a store entry
        self.options = options
        self._task = None
        self._lock = threading.Lock()

    @property
    def task(self):
        if self._task is None:
            with self._lock:
                if self._task is None:
                    from prefect import task
                    from prefect.cache_policies import NO_CACHE

                    options = dict(self.options)
                    if isinstance(options.get("task_run_name"), str):
                        options["task_run_name"] = markup_safe_name(options["task_run_name"])
                    self._task = task(self.fn, **{"persist_result": False, "cache_policy": NO_CACHE, **options})
        return self._task

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.task(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only for what the Step itself does not have: Prefect's attributes
        if name.startswith("__") or name in ("_task", "_lock", "options", "fn", "cache_key"):
            raise AttributeError(name)
        return getattr(self.task, name)

    def __repr__(self) -> str:
        return f"Step({self.options.get('name', self.fn.__name__)})"


def markup_safe_name(template: str) -> Callable[..., str]:
    """A task run name from `template` (formatted as Prefect formats it) with square brackets, also those inside
    parameter values such as paths, turned into parentheses: the name is never rich markup."""
    def name(parameters: dict[str, Any]) -> str:
        return template.format(**parameters).translate(_NO_BRACKETS)
    return name


_NO_BRACKETS = str.maketrans("[]", "()")


def step(**options: Any) -> Callable[[Callable[..., Any]], Step]:
    """Declare a pipeline step with Prefect task options (name, retries, task_run_name, tags, ...) and, for a step
    that writes a store entry, its `cache_key`."""
    def decorate(fn: Callable[..., Any]) -> Step:
        return Step(fn, dict(options))
    return decorate
