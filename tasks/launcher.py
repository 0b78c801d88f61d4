"""Run heavy work in a child process with its own GPU environment, streaming its output into the Prefect logs.

Workers are `python -m tasks.<module> <job.json>` (or torchrun of the same). They write their result as JSON; a
worker that finds bad input exits with USER_ERROR_EXIT after writing the message, so the task raises a
non-retryable error instead of a crash that would be retried.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import traceback
from collections import deque
from pathlib import Path
from typing import Any, Callable

from tasks.errors import UserInputError, WorkerFailed

USER_ERROR_EXIT = 3
PROJECT_ROOT = Path(__file__).resolve().parent.parent
EVENT_PREFIX = "@@event "


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()
    except Exception:  # outside a flow/task run (plain function calls in tests)
        return logging.getLogger("finetune_flows")


def worker_env(gpu_env: dict[str, str]) -> dict[str, str]:
    """The child's environment: ours (less secrets the worker's policy withholds) plus the selected GPUs; our own
    os.environ is never modified."""
    from tasks.policy import worker_environment

    env = worker_environment(dict(os.environ))
    env.update(gpu_env)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TQDM_DISABLE", "1")  # progress comes back as events, not bars
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_worker(
    step: str,
    argv: list[str],
    gpu_env: dict[str, str],
    workdir: Path,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Start the worker, stream its lines to the logs (and `workdir/<step>.log`), return its result JSON."""
    logger = run_logger()
    workdir.mkdir(parents=True, exist_ok=True)
    result_path, error_path = workdir / f"{step}.result.json", workdir / f"{step}.error.json"
    for p in (result_path, error_path):
        p.unlink(missing_ok=True)
    tail: deque[str] = deque(maxlen=40)
    logger.info("starting %s worker: %s (CUDA_VISIBLE_DEVICES=%r)", step, " ".join(argv),
                gpu_env.get("CUDA_VISIBLE_DEVICES"))
    with open(workdir / f"{step}.log", "a") as log:
        proc = subprocess.Popen(
            argv, env=worker_env(gpu_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, cwd=os.getcwd(), start_new_session=True,  # own process group: a kill takes all ranks
        )
        (workdir / f"{step}.pid").write_text(str(proc.pid))
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            log.write(line + "\n")
            at = line.find(EVENT_PREFIX)  # Ray prefixes its workers' lines with "(RayTrainWorker pid=...) "
            if at >= 0:
                if on_event is not None:
                    try:
                        on_event(json.loads(line[at + len(EVENT_PREFIX):]))
                    except Exception as exc:  # a monitoring hiccup must not kill training
                        logger.warning("could not handle event %r: %s", line, exc)
                continue
            tail.append(line)
            if line.strip():
                logger.info("[%s] %s", step, line)
        rc = proc.wait()
    (workdir / f"{step}.pid").unlink(missing_ok=True)
    if rc == USER_ERROR_EXIT and error_path.exists():
        raise UserInputError(json.loads(error_path.read_text())["message"])
    if rc != 0:
        raise WorkerFailed(step, rc, "\n".join(tail))
    return json.loads(result_path.read_text())


def python_module(module: str, job_path: Path) -> list[str]:
    return [sys.executable, "-m", module, str(job_path)]


def torchrun_module(module: str, job_path: Path, nproc: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", module, str(job_path),
    ]


def emit_event(kind: str, **data: Any) -> None:
    """Called inside a worker: a structured line the launcher turns into artifacts (progress, metrics)."""
    print(EVENT_PREFIX + json.dumps({"kind": kind, **data}), flush=True)


def _quiet_progress_bars() -> None:
    """Progress bars are noise in Prefect logs; workers report progress as events instead."""
    import transformers

    transformers.utils.logging.disable_progress_bar()


def worker_main(fn: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Entry point body for `python -m tasks.X job.json`: run fn(job), write its result or the user error."""
    job = json.loads(Path(sys.argv[1]).read_text())
    _quiet_progress_bars()
    workdir = Path(job["workdir"])
    step = job["step"]
    try:
        result = fn(job)
    except UserInputError as exc:
        (workdir / f"{step}.error.json").write_text(json.dumps({"message": str(exc)}))
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        raise
    if result is not None:
        (workdir / f"{step}.result.json").write_text(json.dumps(result, indent=2))


def write_job(workdir: Path, step: str, **fields: Any) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{step}.job.json"
    path.write_text(json.dumps({"step": step, "workdir": str(workdir), **fields}, indent=2, default=str))
    return path
