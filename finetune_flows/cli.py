"""The command line around the flows (`python flows/finetune.py`, `python flows/evaluate.py`).

- Bad input is found before a Prefect server starts (finetune_flows/config/preflight.py) and printed as one message, exit 2; other
  failures a retry cannot fix (a full disk, out of memory at the smallest micro-batch) as one message, exit 1.
- SIGTERM, like Ctrl-C (SIGINT), unwinds the run as an exception, so every `finally` runs: the workers get
  SIGTERM, save a checkpoint and are gone before the device slots are released, and the temporary Prefect server
  is stopped. Exit status 128 + the signal; running the same command again resumes.
- Without PREFECT_API_URL, Prefect starts a temporary server on the SQLite database in PREFECT_HOME. Two of them
  migrating a fresh database at the same time break each other's migration (alembic: "expected to match one row
  ... 0 found"), and Prefect then waits out its 20 s start timeout ("Timed out while attempting to connect to
  ephemeral Prefect API server"). Runs therefore start their temporary server one at a time, under a file lock in
  PREFECT_HOME, with a longer timeout; the migrated database is then shared as before.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from finetune_flows.errors import NotRetryable, UserInputError

T = TypeVar("T")
SERVER_START_TIMEOUT = 180  # seconds; a fresh database's migrations alone take ~15 s on a loaded 2-core machine


class Stopped(KeyboardInterrupt):
    """The run was stopped by a signal (SIGTERM or SIGINT)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _NoTracebackForNotRetryable(logging.Filter):
    """Prefect logs a failed run's exception with its traceback; for bad input or a full disk the message says it
    all, and the CLI prints it once more at the end."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], NotRetryable):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_tracebacks() -> None:
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForNotRetryable) for f in logger.filters):
            logger.addFilter(_NoTracebackForNotRetryable())


def start_temporary_server() -> None:
    """Start Prefect's temporary server for this process, one process at a time per PREFECT_HOME (see above)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, get_current_settings

    if PREFECT_API_URL.value() or not get_current_settings().server.ephemeral.enabled:
        return
    home = Path(PREFECT_HOME.value()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".finetune-flows-server-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        SubprocessASGIServer().start(timeout=SERVER_START_TIMEOUT)  # the engine reuses this running instance


def run_cli(check: Callable[[], object], run: Callable[[], T], show: Callable[[T], None]) -> int:
    """check() (no server yet), then run() the flow, then show() its result; errors as one message."""
    quiet_tracebacks()
    try:
        with stop_on_signals():
            check()
            start_temporary_server()
            result = run()
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
              "(training continues from its last checkpoint)", file=sys.stderr)
        return 128 + exc.signum
    show(result)
    return 0
