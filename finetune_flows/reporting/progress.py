"""Training progress as a person reads it: one live line on a terminal, plain log lines elsewhere.

The training worker reports `train_step` (every optimizer step) and `train_log` (every `train.logging_steps`)
events. On a terminal (a local `python flows/finetune.py`) they redraw one status line in place:

    train  12/40 [######..............]  30%  loss 0.8123  93 tokens/s  ETA 2m05s

Without a terminal (CI, deployment workers, a log file) each `train_log` event becomes one log line instead.
Either way the log lines reach the Prefect API (the run's logs in the UI) and the `train-progress` artifact
moves; on a terminal only the console copy of those lines is replaced by the live line.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from typing import Any, TextIO

from finetune_flows.logs import run_logger

LIVE = "live_progress"  # a log record carrying this attribute is drawn by the live line, not printed again
CLEAR = "\r\x1b[2K"


def format_duration(seconds: float) -> str:
    seconds = int(round(max(seconds, 0)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def progress_line(step: int, total: int, loss: float | None, tokens_per_second: float | None,
                  eta_seconds: float | None, width: int = 20) -> str:
    """`train  12/40 [######..............]  30%  loss 0.8123  93 tokens/s  ETA 2m05s`"""
    fraction = min(1.0, step / total) if total > 0 else 0.0
    filled = int(round(fraction * width))
    parts = [f"train {step:>{len(str(total))}}/{total} [{'#' * filled}{'.' * (width - filled)}] {fraction:4.0%}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    if tokens_per_second is not None:
        parts.append(f"{tokens_per_second:.0f} tokens/s")
    parts.append(f"ETA {format_duration(eta_seconds)}" if eta_seconds is not None else "ETA --")
    return "  ".join(parts)


def _console_handlers(stream: TextIO) -> list[logging.Handler]:
    """The handlers that print to this terminal (Prefect's console handler sits on the root logger)."""
    found = []
    for handler in logging.getLogger().handlers:
        target = getattr(handler, "stream", None)
        if target is stream or (target is not None and _same_tty(target, stream)):
            found.append(handler)
    return found


def _same_tty(a: TextIO, b: TextIO) -> bool:
    try:
        return a.isatty() and b.isatty() and os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):
        return False


class LiveLine(logging.Filter):
    """One status line at the bottom of a terminal, rewritten in place.

    Installed as a filter on the handlers that print to the same terminal: it keeps records marked LIVE off
    the console (the line shows them) and clears the line before any other record is printed, so log lines
    never end up glued to it; the next update draws it again below them. Ours, not rich's Live or tqdm: they keep
    clear only of output written through them (tqdm by replacing the console handlers with its own), and Prefect's
    console handler prints through a rich Console of its own.
    """

    def __init__(self, stream: TextIO):
        super().__init__()
        self.stream = stream
        self.text = ""
        self.shown = False
        self.lock = threading.Lock()
        self.handlers = _console_handlers(stream)
        for handler in self.handlers:
            handler.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, LIVE, False):
            return False
        self.clear()
        return True

    def show(self, text: str) -> None:
        width = shutil.get_terminal_size((120, 24)).columns
        with self.lock:
            self.text = text[: max(width - 1, 20)]
            self.stream.write(CLEAR + self.text)
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        with self.lock:
            if self.shown:
                self.stream.write(CLEAR)
                self.stream.flush()
                self.shown = False

    def close(self) -> None:
        """Leave the last state on screen as an ordinary line."""
        for handler in self.handlers:
            handler.removeFilter(self)
        with self.lock:
            if self.text:
                self.stream.write(CLEAR + self.text + "\n")
                self.stream.flush()
            self.shown = False


class ProgressReporter:
    """Turns worker events into the live line or log lines, and a Prefect progress artifact (`train-progress`).

    Use it as a context manager around the worker so the live line is closed when the worker ends.
    """

    def __init__(self, max_steps: int, stream: TextIO | None = None):
        self.max_steps = max_steps
        self.stream = stream if stream is not None else sys.stderr
        self.live: LiveLine | None = None
        self.artifact_id = None
        self.loss: float | None = None
        self.start: tuple[int, float] | None = None  # (step, elapsed) of the first event of this attempt
        self.last_percent = -1.0

    def __enter__(self) -> "ProgressReporter":
        if _isatty(self.stream):
            self.live = LiveLine(self.stream)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.close()
            self.live = None

    def eta(self, step: int, total: int, elapsed: float) -> float | None:
        """Seconds left at the pace of this attempt (a resumed run starts counting at its first step)."""
        if self.start is None:
            self.start = (step, elapsed)
            return None
        done, spent = step - self.start[0], elapsed - self.start[1]
        return spent / done * max(total - step, 0) if done > 0 and spent > 0 else None

    def __call__(self, event: dict[str, Any]) -> None:
        logger = run_logger()
        kind = event["kind"]
        if kind == "checkpoint":
            logger.info("checkpoint saved at step %s", event["step"])
            if self.live is not None and self.live.text:
                self.live.show(self.live.text)
            return
        if kind not in ("train_step", "train_log"):
            return
        step, total = event["step"], event.get("max_steps") or self.max_steps
        if kind == "train_log":
            self.loss = event["loss"]
        eta = self.eta(step, total, event.get("elapsed", 0.0))
        line = progress_line(step, total, self.loss, event.get("tokens_per_second"),
                             event["eta_seconds"] if event.get("eta_seconds") is not None else eta)
        if self.live is not None:
            self.live.show(line)
        if kind == "train_log":
            rate, lr = event.get("tokens_per_second"), event.get("learning_rate")
            logger.info("step %s/%s loss %.4f lr %s %s", step, total, event["loss"],
                        f"{lr:.3g}" if isinstance(lr, (int, float)) else lr,  # the scheduler's 0.000886363636...
                        "(no step timed yet)" if rate is None else f"{rate:.1f} tokens/s",
                        extra={LIVE: self.live is not None})
        self._update_artifact(float(min(100, round(100 * step / max(total, 1)))))  # at most 101 API calls

    def _update_artifact(self, percent: float) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact
        from prefect.context import FlowRunContext, TaskRunContext

        if percent == self.last_percent or not (TaskRunContext.get() or FlowRunContext.get()):
            return  # outside a Prefect run there is no artifact to move (and no server to start for one)
        self.last_percent = percent
        try:
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(percent, key="train-progress",
                                                            description="QLoRA training progress (%)")
            else:
                update_progress_artifact(self.artifact_id, percent)
        except Exception as exc:  # a monitoring hiccup must not stop training
            run_logger().debug("progress artifact not updated: %s", exc)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
