"""A worker's lifetime, seen from inside the worker (the orchestrator side is finetune_flows/runtime/launcher.py).

- Every worker process (each torchrun rank too) dies with its parent: PR_SET_PDEATHSIG sends it SIGTERM when the
  parent exits, and a worker whose orchestrator is already gone by the time it starts exits at once.
- Training stops gracefully on SIGTERM/SIGINT: the handler only sets a flag; at the next optimizer step every rank
  learns (one tiny all-reduce) whether any rank was asked to stop, so all of them save the same checkpoint and stop
  at the same step. The worker then exits as "interrupted" without writing the final adapter, and the next
  attempt resumes from that checkpoint. A watchdog ends the process if stopping takes longer than the grace
  period (a peer died and a collective hangs).
- Failures are classified where they happen (out of memory, full disk, bad input, interrupted), so the
  orchestrator can adapt or stop instead of retrying blindly.
- Faults can be injected for the fault suite (tests/test_faults.py) through FINETUNE_FLOWS_FAULTS.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable, Iterator

from finetune_flows.errors import UserInputError, first_line
from finetune_flows.files import write_json
from finetune_flows.runtime.processes import ProcessId, ancestors, remove_record_if_mine, write_record

LAUNCHER_ENV = "FINETUNE_FLOWS_LAUNCHER"  # "<pid> <start time>" of the orchestrator that started this worker tree
GRACE_ENV = "FINETUNE_FLOWS_STOP_GRACE"  # seconds a worker has to stop after SIGTERM
FAULTS_ENV = "FINETUNE_FLOWS_FAULTS"  # JSON, see Faults
DEVICE_LOCKS_ENV = "FINETUNE_FLOWS_DEVICE_LOCKS"  # the slot files of the device slots held for this worker
# ... as the task that holds them sees them (orchestration/concurrency.py sets it; the launcher passes it on)
HELD_DEVICE_LOCKS: ContextVar[tuple[str, ...]] = ContextVar("held_device_slot_files", default=())
EVENT_PREFIX = "@@event "  # a worker's structured output line (emit_event)

PR_SET_PDEATHSIG = 1


class Stopped(KeyboardInterrupt):
    """The run was stopped by a signal (SIGTERM or SIGINT)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_stop_requested: int | None = None  # the signal that asked this process to stop, once one has


def request_stop(signum: int) -> None:
    """Record that a signal asked the run to stop (by watch_stop_signals, as the signal arrives)."""
    global _stop_requested
    if _stop_requested is None:
        _stop_requested = signum


def raise_if_stopped() -> None:
    """Raise again, where a stop was recorded, what the signal's handler raised. A handler's exception is lost when
    it lands in an object's finalizer (Python prints "Exception ignored in ... __del__"), and the run would go on:
    the places that wait on a worker, and each step's start, call this. In the main thread the installed handler
    runs again, so the stop takes the way the signal itself would have: Prefect's SIGTERM handler raises its
    TerminationSignal, which a deployment run's cancellation needs to end Cancelled; elsewhere this raises
    Stopped."""
    if _stop_requested is None:
        return
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(_stop_requested)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(_stop_requested, None)
    raise Stopped(_stop_requested)


@contextmanager
def watch_stop_signals(on_signal: Callable[[int], None] | None = None) -> Iterator[bool]:
    """Within this block, record every SIGTERM and SIGINT as it arrives (request_stop, then on_signal), whichever
    Python handler runs for it: the interpreter's C-level handler writes each signal's number to the wakeup fd, read
    here by a thread. Yields whether it watches: only in the main thread, and not where a wakeup fd is already set
    (an outer block of this, or an asyncio loop's signal handling, which keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        yield False
        return

    def watch() -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while data := pipe.read(64):
                for signum in data:
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        request_stop(signum)
                        if on_signal is not None:
                            on_signal(signum)

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()
    try:
        yield True
    finally:
        signal.set_wakeup_fd(-1)
        os.close(write_fd)  # the watcher reads the end of its pipe and returns


_libc = ctypes.CDLL(None, use_errno=True)  # resolved now: preexec_fn runs between fork and exec


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    return _libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def preexec_die_with(parent_pid: int):
    """Popen(preexec_fn=...): the child gets SIGTERM when its parent dies, even by SIGKILL. If the parent died
    before prctl took effect, no signal will ever come, so the child leaves at once."""

    def preexec() -> None:
        set_parent_death_signal()
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def die_with_launcher() -> None:
    """In every worker process: SIGTERM when our parent exits; exit now if our orchestrator is already gone or we
    were orphaned (re-parented away from it) before the death signal was armed."""
    set_parent_death_signal()
    launcher = ProcessId.parse(os.environ.get(LAUNCHER_ENV, ""))
    if launcher is None:  # started by hand, not by run_worker
        return
    if not launcher.is_running() or launcher.pid not in ancestors(os.getpid()):
        print("the orchestrator that started this worker is gone: exiting", file=sys.stderr, flush=True)
        os._exit(1)


# ---------------------------------------------------------------- graceful stop


class TrainingInterrupted(Exception):
    """Training stopped on a signal after saving a checkpoint; the final adapter was not written."""


class GracefulStop:
    """SIGTERM/SIGINT set a flag; the training loop acts on it at the next step end (see stop_callback)."""

    def __init__(self, grace: float, log: Path | None = None):
        self.grace = grace
        self.requested = False
        self.log = log  # the step's log, which the worker writes itself once its launcher is gone

    def install(self) -> GracefulStop:
        try:
            signal.signal(signal.SIGTERM, self._handle)
            signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread (a Ray Train worker): Ray owns that process's lifetime
            pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            return
        self.requested = True
        if self.log is not None and _launcher_gone():
            _output_to(self.log)
        # os.write, not print: the handler may interrupt a print of the main thread
        os.write(2, f"received {signal.Signals(signum).name}: saving a checkpoint at the end of this step, then "
                    f"stopping (at most {self.grace:.0f} s)\n".encode())
        watchdog = threading.Timer(self.grace, self._expire)
        watchdog.daemon = True
        watchdog.start()

    def _expire(self) -> None:
        os.write(2, f"did not stop within {self.grace:.0f} s of the signal: exiting now\n".encode())
        os._exit(INTERRUPTED_EXIT)


def _launcher_gone() -> bool:
    launcher = ProcessId.parse(os.environ.get(LAUNCHER_ENV, ""))
    return launcher is not None and not launcher.is_running()


def _output_to(log: Path) -> None:
    """stdout and stderr appended to `log`: the pipe they were has no reader once the launcher is killed, and the
    first line written to it (EPIPE) would end the worker before it saved its checkpoint."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _any_rank(flag: bool) -> bool:
    """True on every rank if it is True on any (MAX all-reduce of one number); the flag itself on one rank."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag  # one rank: nothing to agree on, and no all-reduce whose .item() waits for the device
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _collator_tokens(dataloader) -> int:
    """Real tokens the collator has seen on this rank (both of the project's collators count them)."""
    return int(getattr(getattr(dataloader, "collate_fn", None), "tokens", 0) or 0)


def peak_memory() -> dict[str, float | None]:
    """This rank's peak memory in MiB: CUDA's max reserved, and the process's whole GPU footprint as NVML sees it
    (context, NCCL buffers, the allocator's reserve); the max RSS on the CPU."""
    import resource

    import torch

    if not torch.cuda.is_available():
        return {"reserved_mb": None, "process_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    reserved = torch.cuda.max_memory_reserved() / 2**20
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            used = sum(p.usedGpuMemory or 0 for i in range(pynvml.nvmlDeviceGetCount())
                       for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
                       if p.pid == os.getpid())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, or a PID namespace that hides our PID from it
        used = 0
    return {"reserved_mb": reserved, "process_mb": used / 2**20 if used else None}


def training_callback(job: dict[str, Any], trainer):
    """The Trainer callback of every training rank: graceful stop on SIGTERM/SIGINT, progress for the accounting
    of all attempts (finetune_flows/training/attempts.py), and injected faults (some of which hook into `trainer`).

    Creating it installs the signal handlers (a signal during model loading still ends the process at once: there
    is nothing to save yet)."""
    from transformers import TrainerCallback

    stop = GracefulStop(float(os.environ.get(GRACE_ENV, "60")), Path(job["workdir"]) / f"{job['step']}.log").install()
    faults = Faults.from_env(job)
    faults.install(trainer)
    rank = int(os.environ.get("RANK", 0))

    class StopOnSignal(TrainerCallback):
        stopped_at: int | None = None
        started = 0.0

        def progress(self, state, dataloader, **extra: Any) -> None:
            emit_event("progress", rank=rank, step=state.global_step, tokens=_collator_tokens(dataloader),
                       seconds=round(time.perf_counter() - self.started, 3), **extra)

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            faults.before_step(state.global_step + 1)

        def on_step_end(self, args, state, control, **kwargs):
            if _any_rank(stop.requested):
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = state.global_step

        def on_log(self, args, state, control, **kwargs):
            self.progress(state, kwargs.get("train_dataloader"))

        def on_train_end(self, args, state, control, **kwargs):
            self.progress(state, kwargs.get("train_dataloader"), **peak_memory())
            if self.stopped_at is not None:
                raise TrainingInterrupted(f"stopped on a signal at step {self.stopped_at} after saving "
                                          f"checkpoint-{self.stopped_at}")

    return StopOnSignal()


# ---------------------------------------------------------------- injected faults (the fault suite)


class Faults:
    """Faults a test asks for through FINETUNE_FLOWS_FAULTS (JSON):

    - `oom_at_step: N` raises torch.OutOfMemoryError before step N while the job's micro_batch_split is below
      `oom_below_split` (default: always), the way CUDA raises it from a forward pass;
    - `sigkill_at_step: N` SIGKILLs rank `sigkill_rank` (default 0) before step N, once: the file `once` is
      created first, so the resumed attempt runs on;
    - `step_seconds: S` sleeps S seconds before every step, so a run on a fast GPU is still training when a test's
      signal arrives;
    - `rng_save_seconds: S` makes rank `rng_save_rank` (default 1) a slow writer of its part of every checkpoint
      (`rng_state_<rank>.pth`, written by each rank after the shared files): the file exists half-written for S
      seconds, as it would on a slow disk, before the Trainer writes it.
    """

    def __init__(self, spec: dict[str, Any], split: int, rank: int):
        self.spec, self.split, self.rank = spec, split, rank

    @classmethod
    def from_env(cls, job: dict[str, Any]) -> Faults:
        return cls(json.loads(os.environ.get(FAULTS_ENV) or "{}"), int(job.get("micro_batch_split", 1)),
                   int(os.environ.get("RANK", 0)))

    def install(self, trainer) -> None:
        seconds = float(self.spec.get("rng_save_seconds", 0))
        if not seconds or self.rank != self.spec.get("rng_save_rank", 1):
            return
        save = trainer._save_rng_state

        def slow_save(output_dir: str) -> None:
            os.makedirs(output_dir, exist_ok=True)
            Path(output_dir, f"rng_state_{self.rank}.pth").write_bytes(b"\0" * 64)
            time.sleep(seconds)
            save(output_dir)

        trainer._save_rng_state = slow_save

    def before_step(self, step: int) -> None:
        s = self.spec
        if s.get("oom_at_step") == step and self.split < s.get("oom_below_split", sys.maxsize):
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory (injected before step {step} with micro_batch_split "
                                         f"{self.split})")
        if s.get("sigkill_at_step") == step and self.rank == s.get("sigkill_rank", 0) and self._first_time():
            os.kill(os.getpid(), signal.SIGKILL)
        if s.get("step_seconds"):
            time.sleep(float(s["step_seconds"]))

    def _first_time(self) -> bool:
        try:
            os.close(os.open(self.spec["once"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False


# ---------------------------------------------------------------- failure classes

USER_ERROR_EXIT, OOM_EXIT, INTERRUPTED_EXIT, DISK_FULL_EXIT = 3, 4, 5, 6
EXIT_CODES = {"user_error": USER_ERROR_EXIT, "oom": OOM_EXIT, "interrupted": INTERRUPTED_EXIT,
              "disk_full": DISK_FULL_EXIT}


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def no_space_left(directory: Path) -> bool:
    """Whether writing under directory fails for lack of space, tried for real (some writers, torch.save among
    them, report a full disk only as a short write)."""
    probe = directory / f".space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 2**18)
            f.flush()
            os.fsync(f.fileno())
        return False
    except OSError as exc:
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    finally:
        probe.unlink(missing_ok=True)


def classify(exc: BaseException, workdir: Path | None = None) -> str | None:
    """user_error | oom | disk_full | interrupted, or None for a plain crash (retried). With workdir, any other
    error counts as disk_full when that directory's filesystem turns out to be full."""
    for e in _chain(exc):
        text = str(e)
        if isinstance(e, UserInputError):
            return "user_error"
        if isinstance(e, TrainingInterrupted):
            return "interrupted"
        if type(e).__name__ == "OutOfMemoryError" or isinstance(e, MemoryError) or (
                "out of memory" in text.lower() and "cuda" in text.lower()):
            return "oom"
        if (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left on device" in text \
                or "os error 28" in text:
            return "disk_full"
    return "disk_full" if workdir is not None and no_space_left(workdir) else None


def failure_path(workdir: Path, step: str, kind: str) -> Path:
    return workdir / (f"{step}.oom.json" if kind == "oom" else f"{step}.error.json")


def report_failure(workdir: Path, step: str, kind: str, message: str, split: int) -> None:
    """Tell the orchestrator what failed: a line on stdout (works on a full disk) and a file (outlives the pipe)."""
    message = message.strip() or kind
    if kind != "user_error":  # user errors may list several problems; OOM messages run on for lines
        message = message.splitlines()[0]
    record = {"cause": kind, "message": message, "split": split}
    emit_event("failure", **record)
    path = failure_path(workdir, step, kind)
    try:
        write_json(path, record, indent=None)
    except OSError:  # the disk may be what failed; the event already carries it
        pass


def emit_event(kind: str, **data: Any) -> None:
    """Called inside a worker: a structured line the launcher turns into artifacts (progress, metrics)."""
    print(EVENT_PREFIX + json.dumps({"kind": kind, **data}), flush=True)


@contextmanager
def rank_record(workdir: Path, rank: int | str | None) -> Iterator[None]:
    """A training rank's pid record (torchrun's or Ray Train's): findable by operators and tests while the rank
    runs, gone after. `rank` None (not a rank) records nothing."""
    if rank is None:
        yield
        return
    record = workdir / "ranks" / f"rank-{rank}.pid"
    record.parent.mkdir(parents=True, exist_ok=True)
    write_record(record)
    try:
        yield
    finally:
        remove_record_if_mine(record)


# bitsandbytes >= 0.49 on a CPU with AVX512-BF16 tries, when it is imported, to fetch an optional 4-bit matmul kernel
# from the Hub and, when it cannot (always, offline), warns "Failed to load CPU gemm_4bit_forward ... Please make sure
# you already `pip install kernels`", then uses its own CPU path; offline, `kernels` first warns that it skips the
# repo's publisher trust check. Nothing is wrong and nothing is missing, so neither line is shown: a note in its place
# came only from the process that first imported bitsandbytes (a fork server, or none when the steps were cached),
# so a run's output differed with what ran before it.
BNB_HUB_KERNEL = "kernels-community/quantization-bitsandbytes"


class _OptionalHubKernelMiss(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        text = record.getMessage()
        return not (text.startswith("Failed to load CPU gemm_4bit_forward") or BNB_HUB_KERNEL in text)


def quiet_optional_hub_kernel_warning() -> None:
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_OptionalHubKernelMiss())
    logging.getLogger("kernels.hf_hub").addFilter(_OptionalHubKernelMiss())


def hold_workers_lock(path: str | None) -> None:
    """Hold the store entry's workers' lock (shared) until this process exits: the entry's next producer waits for
    it, so a worker that outlives its stopped run finishes saving before another writes there (store/entries.py).
    Also a device slot's file: the next run on that device waits for it."""
    if not path:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # left open: the kernel releases it at exit
    except OSError:  # a node that does not share the store's locks (a remote Ray node): nothing to hold here
        return
    fcntl.flock(fd, fcntl.LOCK_SH)


def worker_main(fn: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Entry point body for `python -m finetune_flows.<role>.<module> job.json`: run fn(job), write its result or
    report why it failed."""
    die_with_launcher()
    quiet_optional_hub_kernel_warning()
    job = json.loads(Path(sys.argv[1]).read_text())
    hold_workers_lock(job.get("workers_lock"))
    for path in filter(None, os.environ.get(DEVICE_LOCKS_ENV, "").split(os.pathsep)):
        hold_workers_lock(path)  # the device stays taken while this worker lives (orchestration/concurrency.py)
    workdir = Path(job["workdir"])
    step = job["step"]
    try:
        with rank_record(workdir, os.environ.get("RANK")):
            result = fn(job)
    except Exception as exc:
        kind = classify(exc, workdir)
        if kind is None:
            traceback.print_exc()
            sys.stdout.flush()
            raise
        if kind in ("oom", "disk_full"):
            traceback.print_exc()  # for the log file; the task reports one line
        message = first_line(exc)
        if kind == "disk_full" and "space" not in message:  # e.g. torch.save's "unexpected pos": say what it was
            message = f"{type(exc).__name__} while writing: {message}"
        report_failure(workdir, step, kind, str(exc) if kind == "user_error" else message,
                       int(job.get("micro_batch_split", 1)))
        print(exc if kind == "interrupted" else f"error: {exc}", file=sys.stderr, flush=True)  # a stop is no error
        exit_now(EXIT_CODES[kind])
    if result is not None:
        write_json(workdir / f"{step}.result.json", result)
    exit_now(0)


def exit_now(code: int) -> None:
    """End a worker whose work is on disk without the interpreter's teardown: with torch, transformers, peft and
    bitsandbytes loaded, tearing the modules down takes seconds of CPU after the last line, and every step waited
    for it. Everything the worker writes is written and renamed before this;
    the streams and log handlers are flushed here; the training ranks have left their process group already."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
