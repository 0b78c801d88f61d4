"""Exceptions the pipeline raises on purpose, sorted by whether a retry can help.

`NotRetryable` (bad input, a full disk, an out-of-memory that no smaller micro-batch avoids, a failure that
repeats unchanged) is reported as one message and never retried. Anything else (a crashed or killed worker, a
flaky disk) may be retried, and a training retry resumes from the last checkpoint.
"""

import re


def first_line(exc: BaseException) -> str:
    """An exception's message for a one-line report: its first line, or its type where it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def redact_uri(uri: str) -> str:
    """`uri` for a message: a password in its user part (`http://user:pw@host`) shown as `***`."""
    return re.sub(r"^([a-zA-Z][\w+.-]*://[^/@:]*):[^/@]*@", r"\1:***@", uri)


class NotRetryable(Exception):
    """A retry cannot succeed until someone changes something: reported as one message."""


class UserInputError(NotRetryable):
    """Bad configuration, data or model source (CLI exit status 2)."""


class ConfigError(UserInputError):
    """The run configuration is invalid; the message lists every problem found."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        self.source = source
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


class DataError(UserInputError):
    """The dataset cannot be used (missing file, malformed row, missing column, empty)."""


class ModelSourceError(UserInputError):
    """The model source does not name a loadable model."""


class EnvironmentMismatch(ConfigError):
    """The configuration asks for something this machine cannot do."""


class DiskFull(NotRetryable):
    """No space left where a step writes; nothing written earlier is lost, and a rerun resumes."""


class NotLogged(NotRetryable):
    """A finished run that the tracking server did not take: the run directory holds everything."""


class RepeatedFailure(NotRetryable):
    """The worker failed the same way twice with nothing changed in between (or nothing left to change)."""


class WorkerFailed(RuntimeError):
    """A GPU/CPU worker subprocess exited non-zero. May be retried (crash, preemption)."""

    def __init__(self, step: str, returncode: int, tail: str):
        self.step = step
        self.returncode = returncode
        self.tail = tail
        super().__init__(f"{step} worker exited with code {returncode}; last output:\n{tail}")


class WorkerStartTimeout(WorkerFailed):
    """The worker started no process of its own in the time it had (torchrun: no rank, the rendezvous never met)."""


class RendezvousFailed(WorkerFailed):
    """The nodes of a multi-node run did not meet at the rendezvous; `str()` is the message that says so."""

    def __init__(self, step: str, returncode: int, tail: str, message: str):
        super().__init__(step, returncode, tail)
        self.args = (message,)


class WorkerOOM(WorkerFailed):
    """The worker ran out of device memory with `split` micro-batch pieces; a smaller micro-batch may fit."""

    def __init__(self, step: str, returncode: int, tail: str, split: int, message: str):
        super().__init__(step, returncode, tail)
        self.split = split
        self.message = message


class WorkerInterrupted(WorkerFailed):
    """The worker stopped on SIGTERM after saving a checkpoint; a retry resumes from it."""


def is_retryable(exc: BaseException | None) -> bool:
    return exc is not None and not isinstance(exc, NotRetryable)


def retry_unless_user_error(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry crashes and I/O errors, never what a retry cannot fix."""
    try:
        state.result()
    except Exception as exc:
        return is_retryable(exc)
    return True
