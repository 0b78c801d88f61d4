"""The process worker `make worker` starts: Prefect's, plus a check of every run's job variables before it starts.

Prefect checks job variables against the pool's template when a run is created from a deployment, but not on a
run created directly (`POST /flow_runs/` with `job_variables`), and its process worker merges such a run's `env`
into the flow process's environment whether or not the template declares `env`: `PYTHONPATH`, `LD_PRELOAD`, ...
would run a caller's code before the flow's. This worker refuses, before any process starts, a run whose job
variables (its own or its deployment's) name anything the host's template (deployments/process-pool-template.json)
does not declare as a variable or break that variable's schema, and a run while the server's copy of the pool's
template differs from the host's file (a pool changed through the API behind the host's back). The run ends
Crashed with one message naming each refused variable.

    python -m deployments.worker --pool finetune-gpu [--name NAME] [--work-queue Q ...] [--limit N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from prefect.utilities.schema_tools.validation import validate
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker

TEMPLATE = Path(__file__).resolve().parent / "process-pool-template.json"
# A run's training workers get hardware.stop_grace_seconds (25 s by default) to save and stop; the flow then
# reports its state: this leaves room for both.
STOP_GRACE_S = 90.0


class JobVariablesRefused(RuntimeError):
    """A run's job variables ask for what the pool's template does not let a run set."""


def refused_job_variables(template: dict[str, Any], sources: dict[str, dict[str, Any] | None]) -> list[str]:
    """What each source of job variables ({whose: variables}) sets beyond the template's variables schema: names it
    does not declare (`env`, `command`, `env.X`, ...), and declared ones whose value its schema refuses."""
    schema = template.get("variables") or {}
    declared = schema.get("properties") or {}
    problems = []
    for whose, variables in sources.items():
        variables = variables or {}
        for name in sorted(set(variables) - set(declared)):
            value = variables[name]
            what = f"{name} ({', '.join(sorted(map(str, value)))})" if isinstance(value, dict) and value else name
            allowed = f"a run may set only {', '.join(sorted(declared))}" if declared else "it declares none"
            problems.append(f"{whose} job variables set {what}, which the pool's template does not declare ({allowed})")
        known = {k: v for k, v in variables.items() if k in declared}
        for error in validate(known, schema, preprocess=True, ignore_required=True, allow_none_with_default=True):
            where = ".".join(map(str, error.absolute_path)) or "job variables"
            problems.append(f"{whose} job variables: {where}: {error.message}")
    return problems


def check(template: dict[str, Any], pool_template: dict[str, Any], pool: str,
          sources: dict[str, dict[str, Any] | None]) -> None:
    """Raise JobVariablesRefused naming every problem; the host's template is the one that counts."""
    problems = []
    if pool_template != template:
        problems.append(f"the base job template of work pool {pool!r} on the server differs from this worker's "
                        f"{TEMPLATE.name} (changed through the API?); `make pool` sets it back")
    problems += refused_job_variables(template, sources)
    if problems:
        raise JobVariablesRefused("refused by the worker, before the flow process started: " + "; ".join(problems))


class CheckedJobConfiguration(ProcessJobConfiguration):
    """The process job configuration, built only from job variables the host's template lets a run set."""

    @classmethod
    async def resolve_for_flow_run(cls, flow_run, *, client, work_pool, worker_name, worker_id=None,
                                   deployment=None):
        # The deployment is read here and handed on, so the variables checked are the ones Prefect then merges.
        if deployment is None and flow_run.deployment_id:
            deployment = await client.read_deployment(flow_run.deployment_id)
        check(json.loads(TEMPLATE.read_text()), work_pool.base_job_template, work_pool.name, {
            "the deployment's": getattr(deployment, "job_variables", None), "the run's": flow_run.job_variables})
        return await super().resolve_for_flow_run(flow_run, client=client, work_pool=work_pool,
                                                  worker_name=worker_name, worker_id=worker_id,
                                                  deployment=deployment)


with warnings.catch_warnings():
    # Subclassing registers this class for Prefect's `process` type, over ProcessWorker (it warns so): in this
    # process that is what we want.
    warnings.filterwarnings("ignore", message=".*has key 'process' that matches existing registered type")

    class CheckedProcessWorker(ProcessWorker):
        """Prefect's process worker whose runs start only from job variables the host's template allows."""

        job_configuration = CheckedJobConfiguration
        stopping = False

        async def get_and_submit_flow_runs(self):
            if self.stopping:  # asked to stop: new runs stay scheduled, for another worker or this one's restart
                return []
            return await super().get_and_submit_flow_runs()


def run_until_stopped(worker: CheckedProcessWorker, grace: float) -> None:
    """Run the worker until SIGTERM or SIGINT. Its flow runs are its child processes and die with it (the tether),
    so the first signal stops them as a cancel does: SIGTERM to each, which saves a checkpoint, stops its workers
    and reports the run Crashed, releasing its device slot; the worker takes no new run meanwhile and ends once
    they have, or after `grace` s. A second signal SIGKILLs them at once. (Prefect's own handling leaves the runs
    to finish on their own, which a tethered worker's runs cannot: they would die mid-step and stay Running.)"""
    import psutil

    async def main() -> None:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def now(signum, frame) -> None:
            print(f"Received {signal.Signals(signum).name} again: SIGKILL to the flow runs", flush=True)
            for proc in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            loop.call_soon_threadsafe(task.cancel)

        def first(signum, frame) -> None:
            worker.stopping = True
            runs = psutil.Process().children()
            print(f"Received {signal.Signals(signum).name}: taking no new runs; stopping {len(runs)} running flow "
                  f"run(s) with SIGTERM (they save a checkpoint), up to {grace:.0f} s; again to kill them now",
                  flush=True)
            for proc in runs:
                with contextlib.suppress(psutil.Error):
                    proc.terminate()
            signal.signal(signal.SIGTERM, now)
            signal.signal(signal.SIGINT, now)

            def end() -> None:
                psutil.wait_procs(runs, timeout=grace)
                loop.call_soon_threadsafe(task.cancel)

            threading.Thread(target=end, name="stop-runs", daemon=True).start()

        signal.signal(signal.SIGTERM, first)
        signal.signal(signal.SIGINT, first)
        with contextlib.suppress(asyncio.CancelledError):
            await worker.start()

    asyncio.run(main())
    print(f"Worker {worker.name!r} stopped!", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--name")
    parser.add_argument("--work-queue", action="append", dest="work_queues")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--stop-grace", type=float, default=STOP_GRACE_S,
                        help="seconds the running flow runs get to stop when the worker is stopped")
    args = parser.parse_args(argv)

    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS, PREFECT_WORKER_PREFETCH_SECONDS

    worker = CheckedProcessWorker(
        name=args.name, work_pool_name=args.pool, work_queues=args.work_queues, limit=args.limit,
        prefetch_seconds=PREFECT_WORKER_PREFETCH_SECONDS.value(),
        heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()),
        create_pool_if_not_found=False)  # `make pool` creates it, with the host's template
    run_until_stopped(worker, args.stop_grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
