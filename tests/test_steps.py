"""Steps are Prefect tasks to the flow; the worker processes import the engine, never Prefect."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO, child_env

WORKER_MODULES = ["finetune_flows.training.worker", "finetune_flows.evaluation.worker",
                  "finetune_flows.models.quantize", "finetune_flows.export.merge",
                  "finetune_flows.runtime.environment", "finetune_flows.models.backends",
                  "finetune_flows.training.ray_worker"]


def test_worker_modules_import_without_prefect():
    """Prefect's import took 1.5-2.1 CPU-s of every worker process; none of them needs it."""
    code = ("import importlib, sys\n"
            f"for m in {WORKER_MODULES!r}:\n"
            "    importlib.import_module(m)\n"
            "    assert 'prefect' not in sys.modules, m + ' imported prefect'\n"
            "from finetune_flows.runtime.launcher import run_logger\n"
            "assert run_logger().name == 'finetune_flows' and 'prefect' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_step_is_its_plain_function_and_a_prefect_task_on_first_use():
    from prefect import Task
    from prefect.cache_policies import NO_CACHE

    from finetune_flows.orchestration.steps import step

    @step(name="double-it", retries=2, tags=["t"])
    def double(x: int) -> int:
        """Twice x."""
        return 2 * x

    assert double.fn(4) == 8 and double.__doc__ == "Twice x." and double.__name__ == "double"
    assert isinstance(double.task, Task) and double.task is double.task
    assert double.name == "double-it" and double.retries == 2 and double.tags == {"t"}
    assert double.task.persist_result is False and double.task.cache_policy is NO_CACHE
    assert isinstance(double.with_options(retries=0), Task)


class _Value:
    """Any parameter of a step, any attribute of it (cfg.data.source, plan.eval_attn): an absolute path with square
    brackets, the value that once ended `prefect deployment run --watch` with rich's MarkupError."""

    TEXT = "/abs/data [v2]/rows[/x].jsonl"

    def __getattr__(self, name: str) -> _Value:
        return self

    def __format__(self, spec: str) -> str:
        return self.TEXT


def test_every_step_task_run_name_is_safe_for_prefects_cli():
    """Each step's task run name, resolved as Prefect resolves it, printed as `--watch` prints a task-run event."""
    import importlib
    import inspect
    import io
    import uuid

    from prefect._internal.engine import resolve_custom_task_run_name
    from prefect.cli.flow_runs_watching import FlowRunFormatter
    from prefect.events import Event
    from rich.console import Console

    from finetune_flows.orchestration.steps import Step

    modules = [p.stem for p in (Path(__file__).resolve().parent.parent / "tasks").glob("*.py") if p.stem != "__init__"]
    steps = [obj for m in modules for obj in vars(importlib.import_module(f"tasks.{m}")).values()
             if isinstance(obj, Step) and obj.options.get("task_run_name")]
    assert len(steps) >= 9, steps
    for step in steps:
        parameters = {p: _Value() for p in inspect.signature(step.fn).parameters}
        name = resolve_custom_task_run_name(step.task, parameters)
        event = Event(event="prefect.task-run.Running", resource={
            "prefect.resource.id": f"prefect.task-run.{uuid.uuid4()}", "prefect.resource.name": name})
        out = io.StringIO()
        Console(file=out, width=400).print(FlowRunFormatter().format(event))  # raised MarkupError before
        assert name.startswith(step.options["name"]) and name in out.getvalue(), (name, out.getvalue())
        assert "/abs/data (v2)/rows(/x).jsonl" in name, name  # the value is still read, brackets as parentheses
