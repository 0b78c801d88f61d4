"""Run heavy work in a child process with its own GPU environment, streaming its output into the Prefect logs.

Workers are `python -m finetune_flows.<role>.<module> <job.json>` (or torchrun of the same). They write their result
as JSON. A worker's lifetime is tied to the task that started it:
- the child runs in its own session (a signal to its group reaches torchrun and the evaluator alike) and gets
  SIGTERM from the kernel if this process dies, even by SIGKILL (PR_SET_PDEATHSIG; finetune_flows/runtime/lifecycle.py);
- whatever ends the wait here (cancellation, SIGTERM/SIGINT, an error) first sends SIGTERM to the worker's process
  tree (training ranks save a checkpoint and stop), then SIGKILL after `stop_grace` seconds, and returns only
  when every process of it is gone: the caller's device slot is released after the device is free.
A worker reports why it failed (bad input, out of memory, disk full, interrupted) as an event line and a file, so
the task can stop, adapt or retry instead of treating every exit code alike (torchrun exits 1 for all of them).
"""

from __future__ import annotations

import getpass
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from finetune_flows.runtime import forkserver
from finetune_flows.errors import (
    DiskFull, UserInputError, WorkerFailed, WorkerInterrupted, WorkerOOM, WorkerStartTimeout)
from finetune_flows.logs import run_logger
from finetune_flows.runtime.lifecycle import (
    DEVICE_LOCKS_ENV, EVENT_PREFIX, GRACE_ENV, HELD_DEVICE_LOCKS, LAUNCHER_ENV, classify, failure_path,
    preexec_die_with, raise_if_stopped,
)
from finetune_flows.runtime.policy import worker_environment
from finetune_flows.runtime.processes import (
    ProcessId, describe, remove_stale_records, signal_tree, tree, wait_gone, write_record)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_STOP_GRACE = 25.0  # below the 30 s a Prefect worker waits after SIGTERM before it SIGKILLs a flow run
FAILURE_ORDER = ("user_error", "disk_full", "oom", "interrupted")  # the most telling cause first
# Every worker hashes strings the same way: PEFT writes `all-linear` target modules from a set, and with a fixed hash
# seed adapter_config.json is byte-stable, so one config trains one adapter, byte for byte (and its evaluation has
# one cache key). One value for every step also lets one fork server serve them all (runtime/forkserver.py).
STABLE_HASHES = {"PYTHONHASHSEED": "0"}
# A Python exception's last traceback line (`[rank1]: ` where torch prefixes a rank's), not torchrun's own
RAISED = re.compile(r"^(\[rank\d+\]: )?(?!torch\.distributed\.elastic)[A-Za-z_][\w.]*(Error|Exception): ")


def worker_env(gpu_env: dict[str, str]) -> dict[str, str]:
    """The child's environment: ours (less secrets the worker's policy withholds) plus the selected GPUs; our own
    os.environ is never modified."""
    env = worker_environment(dict(os.environ))
    env.update(gpu_env)
    env.update(STABLE_HASHES)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TQDM_DISABLE", "1")  # progress comes back as events, not bars
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' own bars (read when it is imported)
    # flash-attention-4 compiles its kernels on first use in every process; its own on-disk cache (locked, atomic,
    # keyed by FA4's source) lets the attention probe's compilation serve the workers after it (in
    # `compile_caches`' folder where the step passes one). FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0 turns it off.
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
    return env


# Packed micro-batches change shape at every step, and the caching allocator's fixed-size segments then fragment
# (reserved memory far above what a step allocates: benchmarks/results/train-bench-1xGPU-20261202-224238/NOTE.md).
# Expandable segments map more memory into one growing segment instead (PyTorch's documented remedy for varying
# batch sizes). Training workers get it unless the user's environment sets the allocator itself.
TRAINING_ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def training_env(gpu_env: dict[str, str]) -> dict[str, str]:
    """The selected GPUs' variables for a training worker, with the allocator setting above where it trains on GPUs
    and our own environment has no PYTORCH_CUDA_ALLOC_CONF (which worker_env passes on). Not on the CPU: there it
    changes nothing but the environment, and a worker whose environment differs cannot fork from the fork server the
    other steps' workers share (runtime/forkserver.py), so it would start, and import torch, a second one."""
    on_gpu = bool(gpu_env.get("CUDA_VISIBLE_DEVICES"))
    allocator = TRAINING_ALLOCATOR if on_gpu and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ else {}
    return {**allocator, **gpu_env}


# The compilers' on-disk caches: torch.compile's (inductor and AOTAutograd), Triton's (Liger's kernels) and
# flash-attention-4's (CuTe DSL); each keys its entries by its own sources and versions.
COMPILE_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
                  "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash-attn-cute"}


def compile_caches(cache_root: Path, selection) -> dict[str, str]:
    """The compilers' caches in the project's cache, `<cache_dir>/compile/<GPU model>/`, instead of /tmp and ~/.triton,
    which a fresh container (a Prefect Docker or Kubernetes worker's flow run) or a cleaned /tmp loses: a run on a
    cache that has trained on that GPU model before starts from compiled kernels. One folder per GPU model (and one
    for the CPU), so hosts with different GPUs can share the cache. A variable the user set in the environment wins."""
    root = cache_root / "compile" / gpu_models(selection)
    return {var: str(root / folder) for var, folder in COMPILE_CACHES.items()
            if os.environ.get(var) in (None, torch_default_cache(var))}


def torch_default_cache(var: str) -> str | None:
    """The value torch itself writes into os.environ on Inductor's first use (torch/_inductor/runtime/
    cache_dir_utils.py; importing a transformers model is enough): not a choice of the user's."""
    if var != "TORCHINDUCTOR_CACHE_DIR":
        return None
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def gpu_models(selection) -> str:
    """The selected GPU models (`NVIDIA-H200-sm90`; `cpu` without GPUs), as one file name."""
    kinds = sorted({f"{g.name}-sm{g.capability[0]}{g.capability[1]}" for g in selection.gpus}) or ["cpu"]
    return re.sub(r"[^A-Za-z0-9.-]+", "-", "+".join(kinds))


class WorkerOutput:
    """The worker's merged stdout/stderr: read by a thread, handled here (log file, Prefect log, events)."""

    def __init__(self, step: str, log_path: Path, logger, on_event: Callable[[dict[str, Any]], None] | None):
        self.step, self.logger, self.on_event = step, logger, on_event
        self.tail: deque[str] = deque(maxlen=40)
        self.first_raised: str | None = None  # the first exception a process printed: what a failure began with
        self.failures: list[dict[str, Any]] = []
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.ended = False  # the reader reached the end of the output: every process holding the pipe is gone
        self.log = self._open(log_path)

    def _open(self, path: Path):
        try:
            return open(path, "a")
        except OSError as exc:
            self.logger.warning("cannot write %s (%s): the worker's output goes to the Prefect log only", path, exc)
            return None

    def start(self, stream) -> None:
        def read() -> None:
            for line in stream:
                self.lines.put(line.rstrip("\n"))
            self.lines.put(None)

        threading.Thread(target=read, daemon=True, name=f"{self.step}-output").start()

    def follow(self, on_tick: Callable[[], None], exited: Callable[[], bool]) -> None:
        """Handle lines until the worker closes its output, or until its own process has exited and a second has
        passed without a line: a process it left behind may hold the pipe open for as long as it runs (stop_worker
        ends it). on_tick runs every couple of seconds."""
        last = time.monotonic()
        while True:
            raise_if_stopped()
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                if exited():
                    return
                line = ""
            if line is None:
                self.ended = True
                return
            if line:
                self.handle(line, live=True)
            if time.monotonic() - last > 2.0:
                on_tick()
                last = time.monotonic()

    def drain(self) -> None:
        """Handle what is queued without waiting (while the worker shuts down; it must never block on a full pipe)."""
        self.finish(0.0)

    def finish(self, timeout: float) -> None:
        """Handle the rest of the output up to its end, waiting at most `timeout` s for it: once the worker is gone
        the reader thread may still be behind with the last lines in the pipe (a rank's "received SIGTERM: saving a
        checkpoint" was lost that way)."""
        deadline = time.monotonic() + timeout
        while not self.ended:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if line is None:
                self.ended = True
            else:
                self.handle(line, live=False)

    def handle(self, line: str, live: bool) -> None:
        if self.log is not None:
            try:
                self.log.write(line + "\n")
                self.log.flush()
            except OSError as exc:  # e.g. the disk filled up: keep streaming, stop writing the file
                self.logger.warning("stopped writing the %s log: %s", self.step, exc)
                self.log = None
        at = line.find(EVENT_PREFIX)  # Ray prefixes its workers' lines with "(RayTrainWorker pid=...) "
        if at >= 0:
            try:
                event = json.loads(line[at + len(EVENT_PREFIX):])
            except ValueError:
                return
            if event.get("kind") == "failure":
                self.failures.append(event)
            elif live and self.on_event is not None:
                try:
                    self.on_event(event)
                except Exception as exc:  # a monitoring hiccup must not kill training
                    self.logger.warning("could not handle event %r: %s", line, exc)
            return
        self.tail.append(line)
        if self.first_raised is None and RAISED.match(line):
            self.first_raised = line
        if line.strip():
            self.logger.info("[%s] %s", self.step, line)

    def close(self) -> None:
        if self.log is not None:
            try:
                self.log.close()
            except OSError:
                pass


def stop_worker(proc: subprocess.Popen | forkserver.ForkedWorker, members: set[ProcessId], grace: float,
                output: WorkerOutput, logger) -> None:
    """SIGTERM to the worker's group and every process below it, SIGKILL after `grace` s; wait until all are gone."""
    current = set(tree(proc.pid)) if proc.poll() is None else set()  # an exited PID may be reused already
    members = {m for m in members | current if m.is_running()}
    if not members:
        return
    listed = ", ".join(describe(m.pid) for m in sorted(members, key=lambda m: m.pid))
    if proc.poll() is None:
        logger.warning("stopping the %s worker (pids %s): SIGTERM now, SIGKILL after %.0f s", output.step,
                       listed, grace)
    else:  # the worker's own process has exited: what is left is something it started and did not end
        logger.warning("the %s worker exited (code %s) leaving processes behind: %s; SIGTERM now, SIGKILL after "
                       "%.0f s", output.step, proc.poll(), listed, grace)
    started = time.monotonic()
    try:
        signal_tree(list(members), proc.pid, signal.SIGTERM)
        wait_gone(list(members), grace, while_waiting=output.drain)
    finally:  # also after a second Ctrl-C during the grace period
        survivors = [m for m in members if m.is_running()]
        if survivors:
            waited = time.monotonic() - started
            why = (f"did not stop within {grace:.0f} s" if waited >= grace else
                   f"was stopped again {waited:.1f} s into its {grace:.0f} s to stop (a second Ctrl-C or signal); "
                   "what it had not saved is lost")
            logger.warning("the %s worker %s: SIGKILL to pids %s", output.step, why, sorted(m.pid for m in survivors))
            signal_tree(survivors, proc.pid, signal.SIGKILL)
            wait_gone(survivors, 30)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in the kernel (D state): nothing more a signal can do
            logger.error("the %s worker (pid %s) survives SIGKILL", output.step, proc.pid)
        output.drain()
        logger.info("the %s worker stopped %.1f s after the first signal", output.step, time.monotonic() - started)


def run_worker(
    step: str,
    argv: list[str],
    gpu_env: dict[str, str],
    workdir: Path,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    stop_grace: float = DEFAULT_STOP_GRACE,
    start_within: float | None = None,
    on_start: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Start the worker, stream its lines to the logs (and `workdir/<step>.log`), return its result JSON.
    `start_within`: seconds by which the worker must have started a process of its own (torchrun starts its ranks
    once the rendezvous completes), else it is stopped and WorkerStartTimeout raised; `on_start` runs when it has."""
    logger = run_logger()
    workdir.mkdir(parents=True, exist_ok=True)
    result_path = workdir / f"{step}.result.json"
    for p in (result_path, *(failure_path(workdir, step, k) for k in ("oom", "user_error"))):
        p.unlink(missing_ok=True)
    env = worker_env(gpu_env)
    env[LAUNCHER_ENV] = str(ProcessId.of(os.getpid()))
    env[GRACE_ENV] = str(stop_grace)
    env[DEVICE_LOCKS_ENV] = os.pathsep.join(HELD_DEVICE_LOCKS.get())
    output = WorkerOutput(step, workdir / f"{step}.log", logger, on_event)
    proc = start_worker(step, argv, env, logger)
    members: set[ProcessId] = set()
    started_at, waiting = time.monotonic(), start_within is not None

    def remember_members() -> None:  # ranks that outlive a dead torchrun are found through this list
        nonlocal waiting
        below = tree(proc.pid)
        members.update(below)
        if waiting and len(below) > 1:  # a process below the worker's own
            waiting = False
            if on_start is not None:
                on_start()
        elif waiting and proc.poll() is None and time.monotonic() - started_at > start_within:
            raise WorkerStartTimeout(step, -1, "\n".join(output.tail) + f"\nno process started within "
                                     f"{start_within:.0f} s")

    record = workdir / f"{step}.pid"
    try:
        output.start(proc.stdout)
        remember_members()
        _write_quietly(record, proc.pid)
        output.follow(remember_members, lambda: proc.poll() is not None)
        rc = proc.wait()
    finally:
        stop_worker(proc, members, stop_grace, output, logger)
        output.finish(timeout=5.0)
        output.close()
        record.unlink(missing_ok=True)
        # the pid records of ranks killed before they could remove their own (a SIGKILL; torchrun's SIGTERM to a
        # rank still starting, when its peer had failed first)
        remove_stale_records(workdir / "ranks")
    _raise_failure(step, rc, workdir, output)
    return json.loads(result_path.read_text())


def start_worker(step: str, argv: list[str], env: dict[str, str], logger) -> subprocess.Popen | forkserver.ForkedWorker:
    """A fresh process for `argv`, or for a CPU worker of a small step a fork of the pre-imported fork server
    (finetune_flows/runtime/forkserver.py): the same module, arguments, environment and working directory either way."""
    cwd = os.getcwd()
    if argv[:2] == [sys.executable, "-m"] and len(argv) == 4 and forkserver.wanted(argv[2], env):
        try:
            proc = forkserver.spawn(argv[2], argv[3:], env, cwd)
            logger.info("starting %s worker: %s (CUDA_VISIBLE_DEVICES=%r; pid %s, forked from the fork server, pid %s)",
                        step, " ".join(argv), env.get("CUDA_VISIBLE_DEVICES"), proc.pid, proc.server.proc.pid)
            return proc
        except (OSError, RuntimeError) as exc:
            logger.warning("the fork server could not start the %s worker (%s): starting a fresh process", step, exc)
    logger.info("starting %s worker: %s (CUDA_VISIBLE_DEVICES=%r)", step, " ".join(argv),
                env.get("CUDA_VISIBLE_DEVICES"))
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        bufsize=1, cwd=cwd, start_new_session=True, preexec_fn=preexec_die_with(os.getpid()),
    )


def _write_quietly(record: Path, pid: int) -> None:
    try:
        write_record(record, pid)  # lets an operator (or a test) find the worker
    except OSError:
        pass


def _raise_failure(step: str, rc: int, workdir: Path, output: WorkerOutput) -> None:
    reported = list(output.failures)
    for kind in ("oom", "user_error"):
        try:
            reported.append(json.loads(failure_path(workdir, step, kind).read_text()))
        except (OSError, ValueError):
            pass
    if not reported and rc == 0:
        return
    tail = "\n".join(output.tail)
    if output.first_raised is not None and output.first_raised not in output.tail:
        # torchrun's summary of every rank fills the tail: keep the exception the failure began with in it
        tail = f"{output.first_raised}\n...\n{tail}"
    known = [f for f in reported if f.get("cause") in FAILURE_ORDER]
    if not known:
        raise WorkerFailed(step, rc, tail)
    failure = min(known, key=lambda f: FAILURE_ORDER.index(f["cause"]))
    kind, message = failure["cause"], failure.get("message", "")
    if kind == "user_error":
        raise UserInputError(message)
    if kind == "disk_full":
        raise DiskFull(f"{step}: no space left on the device under {workdir} ({message}). Nothing written earlier "
                       "was lost: free some space and run again (training resumes from its last checkpoint).")
    if kind == "oom":
        raise WorkerOOM(step, rc, tail, int(failure.get("split", 1)), message)
    raise WorkerInterrupted(step, rc, tail)


def python_module(module: str, job_path: Path) -> list[str]:
    return [sys.executable, "-m", module, str(job_path)]


def torchrun_log_dir(job_path: Path) -> str:
    """torchrun's folder for its attempts (and a failed rank's error.json): beside the job, where it goes with the
    run, instead of a torchelastic_* folder left in the system's temporary directory by every launch."""
    return f"--log-dir={job_path.parent / 'torchrun'}"


def torchrun_module(module: str, job_path: Path, nproc: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        torchrun_log_dir(job_path), "-m", module, str(job_path),
    ]


def write_job(workdir: Path, step: str, **fields: Any) -> Path:
    path = workdir / f"{step}.job.json"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": step, "workdir": str(workdir), **fields}, indent=2, default=str))
    except OSError as exc:
        if classify(exc) == "disk_full":
            raise DiskFull(f"{step}: cannot write {path}: {exc}") from None
        raise
    return path
