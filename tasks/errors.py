"""Exceptions the pipeline raises on purpose.

`UserInputError` and its subclasses mean "the input is wrong": a retry cannot help, so the flow's retry
conditions refuse to retry them. Anything else (a crashed training process, a flaky disk) may be retried.
"""


class UserInputError(Exception):
    """Bad configuration, data or model source. Never retried."""


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


class WorkerFailed(RuntimeError):
    """A GPU/CPU worker subprocess exited non-zero. May be retried (crash, OOM, preemption)."""

    def __init__(self, step: str, returncode: int, tail: str):
        self.step = step
        self.returncode = returncode
        self.tail = tail
        super().__init__(f"{step} worker exited with code {returncode}; last output:\n{tail}")


def is_retryable(exc: BaseException | None) -> bool:
    return exc is not None and not isinstance(exc, UserInputError)


def retry_unless_user_error(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry crashes and I/O errors, never bad input."""
    try:
        state.result()
    except Exception as exc:
        return is_retryable(exc)
    return True
