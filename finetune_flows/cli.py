"""The command line around the flows (`python flows/finetune.py`, `python flows/evaluate.py`).

- Bad input is found before a Prefect server starts (config/preflight.py) and printed as one message, exit 2;
  other failures a retry cannot fix (a full disk, out of memory at the smallest micro-batch) as one message,
  exit 1.
- SIGTERM, like Ctrl-C (SIGINT), unwinds the run as an exception, so every `finally` runs: the workers get
  SIGTERM, save a checkpoint and are gone before the device slots are released, and the temporary Prefect server
  is stopped. Exit status 128 + the signal; running the same command again resumes.
- One signal ends the process within `hardware.stop_grace_seconds` + STOP_MARGIN_SECONDS, and at most
  DRAIN_SECONDS after the run has unwound, whatever Prefect's background services still hold: with the API server
  gone, Prefect retried reporting the crash for a minute and its event worker's drain at interpreter exit retried
  for good. The temporary server runs in a session of its own, so a signal to the run's process group (a
  terminal's Ctrl-C) leaves it serving until the run has reported its stop.
- Without PREFECT_API_URL, Prefect starts a temporary server on the SQLite database in PREFECT_HOME. Two of them
  migrating a fresh database at the same time break each other's migration (alembic: "expected to match one row
  ... 0 found"), and Prefect then waits out its 20 s start timeout ("Timed out while attempting to connect to
  ephemeral Prefect API server"). Runs therefore start their temporary server one at a time, under a file lock in
  PREFECT_HOME, with a longer timeout; the migrated database is then shared as before.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import functools
import logging
import os
import signal
import sys
import threading
import time
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from finetune_flows.config.schema import HardwareConfig
from finetune_flows.errors import NotRetryable, UserInputError
from finetune_flows.runtime.lifecycle import Stopped, preexec_die_with, request_stop, watch_stop_signals

T = TypeVar("T")
C = TypeVar("C")
SERVER_START_TIMEOUT = 180  # seconds; a fresh database's migrations are slow on a loaded machine
STOP_MARGIN_SECONDS = 10  # after the workers' grace period: releasing device slots, Prefect's own teardown
DRAIN_SECONDS = 3  # after the run has unwound: Prefect's background services flush what they can
_stop_grace: float | None = None  # the run's hardware.stop_grace_seconds, once its config is checked


def _raise_stopped(signum: int, frame) -> None:
    request_stop(signum)  # also where no watcher holds the wakeup fd (watch_stop_signals stood aside)
    _arm_stop_deadline(signum)
    raise Stopped(signum)


_deadline_armed = threading.Event()


def _arm_stop_deadline(signum: int) -> None:
    """On the first stop signal: end the process by the run's grace period + STOP_MARGIN_SECONDS."""
    if _deadline_armed.is_set():
        return
    _deadline_armed.set()
    grace = _stop_grace if _stop_grace is not None else HardwareConfig.model_fields["stop_grace_seconds"].default
    _exit_after(grace + STOP_MARGIN_SECONDS, signum, f"the run did not finish stopping within "
                f"{grace + STOP_MARGIN_SECONDS:.0f} s (its worker processes stop with this one; run the same command "
                "again to resume)")


def _exit_after(seconds: float, signum: int, why: str) -> None:
    """End the process with 128 + signum after `seconds`, from a daemon thread: it still runs while the interpreter
    waits at exit on Prefect's non-daemon services, and os._exit skips them. The run's worker processes and the
    temporary server die with this process (PR_SET_PDEATHSIG)."""
    def end() -> None:
        time.sleep(seconds)
        print(f"stopped by {signal.Signals(signum).name}: {why}; ending now", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + signum)

    threading.Thread(target=end, name="stop-deadline", daemon=True).start()


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise Stopped. Each is also recorded, and its deadline started, when it arrives, not when
    our handler runs (watch_stop_signals): during a flow run Prefect's own SIGTERM handler raises first and hands the
    signal back to ours only after it has reported the crash (which, with the API server gone, it retried for a
    minute); and an exception raised inside an object's finalizer is lost, Prefect's or ours ("Exception ignored in
    ... __del__"). The recorded stop is raised again where the run waits (raise_if_stopped)."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with watch_stop_signals(on_signal=_arm_stop_deadline):
            yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _NoTracebackForNotRetryable(logging.Filter):
    """Prefect logs a failed run's exception with its traceback; for bad input or a full disk the message says it
    all, and the CLI prints it once more at the end. Parameters that fail the flow's own validation (a run
    created with `enforce_parameter_schema: false`) are bad input too: Prefect's ParameterTypeError, which names
    each key, is logged before the flow's body runs, so its message takes the traceback's place."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.exceptions import ParameterTypeError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ParameterTypeError):
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", None
        if isinstance(exc, (NotRetryable, ParameterTypeError)):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_tracebacks() -> None:
    """Called where the flows' modules are imported: the engine imports a flow's module before it validates the
    run's parameters, which fails before the flow's body runs."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForNotRetryable) for f in logger.filters):
            logger.addFilter(_NoTracebackForNotRetryable())


def start_temporary_server() -> None:
    """Start Prefect's temporary server for this process, one process at a time per PREFECT_HOME (see above)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, get_current_settings

    if PREFECT_API_URL.value() or not get_current_settings().server.ephemeral.enabled:
        return
    home = Path(PREFECT_HOME.value()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".finetune-flows-server-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        _server_that_dies_with_us().start(timeout=SERVER_START_TIMEOUT)  # the engine reuses this running instance


def _server_that_dies_with_us():
    """Prefect's temporary server (one instance per process: SubprocessASGIServer() returns it to the engine too),
    whose process gets SIGTERM when this one dies, also by SIGKILL (PR_SET_PDEATHSIG, as the workers): Prefect stops
    it only from an atexit hook, which a killed process never runs, and an orphaned server kept running for good.
    It runs in a session of its own, so a terminal's Ctrl-C (SIGINT to the whole foreground group) stops the run
    but not the server the run reports its stop to: with the server gone first, Prefect retried that report until
    the stop deadline ended the process."""
    import prefect.server.api.server as server_module

    class ServerThatDiesWithUs(server_module.SubprocessASGIServer):
        def _run_uvicorn_command(self):
            real = server_module.subprocess
            dies_with_us = functools.partial(real.Popen, preexec_fn=preexec_die_with(os.getpid()),
                                             start_new_session=True)
            server_module.subprocess = types.SimpleNamespace(Popen=dies_with_us)  # Prefect's one Popen call
            try:
                return super()._run_uvicorn_command()
            finally:
                server_module.subprocess = real

    return ServerThatDiesWithUs()


class Once(argparse.Action):
    """An option given at most once (argparse would keep the last of a repeated `--config`: one run per command)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = f"_{self.dest}_given"
        first = getattr(namespace, given, None)
        if first:
            twice = "more than once" if first == option_string else f"after {first} (the same option)"
            parser.error(f"{option_string} given {twice}: one run per command (run it once per {self.dest})")
        setattr(namespace, given, option_string)
        setattr(namespace, self.dest, values)


def print_to_pipe(text: str) -> None:
    """print(text) for output a reader may stop reading early (`--help-config | head`): a closed pipe ends the
    output quietly instead of with a BrokenPipeError traceback, also at the interpreter's final flush."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere at exit
        os.close(devnull)


def run_cli(check: Callable[[], C], run: Callable[[C], T] | None, show: Callable[[T], None]) -> int:
    """check() (no server yet), then run() the flow on what it returned (usually the config), then show() the
    result; errors as one message. Without run, show() what check() returned."""
    global _stop_grace
    quiet_tracebacks()
    try:
        with stop_on_signals():
            checked = check()
            if run is None:
                result = checked
            else:
                _stop_grace = getattr(getattr(checked, "hardware", None), "stop_grace_seconds", None)
                start_temporary_server()
                result = run(checked)
    except UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NotRetryable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: no space left on the device: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        print(f"stopped by {exc}: the run's worker processes are stopped; run the same command again to resume "
              "(finished steps are reused, a stopped training continues from its last checkpoint)",
              file=sys.stderr, flush=True)
        _exit_after(DRAIN_SECONDS, exc.signum, "Prefect's background services did not finish")
        return 128 + exc.signum
    show(result)
    return 0
