"""Steps are Prefect tasks to the flow; the worker processes import the engine, never Prefect."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, child_env

WORKER_MODULES = ["finetune_flows.training.worker", "finetune_flows.evaluation.worker", "finetune_flows.models.quantize",
                  "finetune_flows.export.merge", "finetune_flows.runtime.environment", "finetune_flows.models.backends",
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
