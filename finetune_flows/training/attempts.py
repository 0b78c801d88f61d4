"""The training attempts behind one content-addressed adapter: out-of-memory adaptation, failures that repeat,
and the accounting of all attempts together.

Files in the adapter's output directory (each written atomically: finetune_flows/files.py):
- `adapt.json`: `{"split": S, "history": [...]}`. An out-of-memory attempt doubles S at once (no retry delay, no
  crash retry used up, the device slot stays held): every micro-batch is cut into S pieces and the gradient
  accumulation multiplied by S, so each optimizer step sees the same rows and the results do not change, only the
  peak memory. When a micro-batch cannot get smaller (one row per piece, or S = 64) the task stops with one
  message instead.
- `layout.json`: the packed micro-batch size and accumulation the checkpoints are trained with. They decide which rows
  share an optimizer step, so a resume keeps them (kept_layout) whatever this GPU's free memory or budget plans now.
- `attempts.json`: one record per attempt (outcome, split, checkpoint it resumed from, steps, tokens and seconds
  measured up to its last logged step), updated while the attempt runs, so even an orchestrator killed mid-run
  leaves what it measured. A crash that repeats the same error from the same checkpoint is not retried again.
"""

from __future__ import annotations

import json
import math
import re
import signal
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from finetune_flows.files import write_json
from finetune_flows.errors import NotRetryable, RepeatedFailure, WorkerFailed, WorkerInterrupted, WorkerOOM
from finetune_flows.logs import run_logger
from finetune_flows.training.planner import TrainingPlan

MAX_SPLIT = 64
EventHandler = Callable[[dict[str, Any]], None]


def _read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def split_limit(packing: bool, micro_batch_tokens: int, micro_batch_rows: int, longest_row: int) -> int:
    """The largest split that still makes micro-batches smaller: a piece holds at least one row."""
    pieces = math.ceil(micro_batch_tokens / max(longest_row, 1)) if packing else micro_batch_rows
    return max(1, min(MAX_SPLIT, pieces))


def current_split(out: Path) -> int:
    return int(_read_json(out / "adapt.json", {}).get("split", 1))


def adapt_after_oom(out: Path, oom: WorkerOOM, limit: int) -> int:
    """Double the split after an out-of-memory attempt; stop when the micro-batch cannot get smaller."""
    adapt = _read_json(out / "adapt.json", {"split": 1, "history": []})
    split = max(int(adapt.get("split", 1)), oom.split)
    if split >= limit:
        raise RepeatedFailure(
            f"training ran out of memory even with each micro-batch cut into {split} pieces (at most {limit}: "
            f"a piece holds at least one row): {oom.message}. Lower data.max_length or train.micro_batch_tokens, "
            "turn on train.gradient_checkpointing, or select GPUs with more free memory")
    new = min(limit, 2 * split)
    history = adapt.get("history", []) + [{"split": split, "new_split": new, "message": oom.message,
                                           "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}]
    write_json(out / "adapt.json", {"split": new, "history": history})
    return new


LAYOUT = "layout.json"
_LAYOUT_KEYS = ("micro_batch_tokens", "gradient_accumulation_steps")


def kept_layout(out: Path, tplan: TrainingPlan, resuming: bool) -> tuple[TrainingPlan, int]:
    """The plan to train with, and the least split of each micro-batch. Packed rows fill micro-batches of the plan's
    size (data/packing.py), so that size decides which rows share a step: a run resuming from checkpoints keeps the
    layout they were trained with, its micro-batches cut into pieces (as after an out-of-memory attempt, the same
    rows each step) where this plan's are smaller. Otherwise this plan's layout is recorded for a later resume."""
    if not tplan.packing:  # padded batches: per_device_batch_size rows, whatever the memory
        return tplan, 1
    layout = {k: getattr(tplan, k) for k in _LAYOUT_KEYS}
    saved = _read_json(out / LAYOUT, None) if resuming else None
    if not isinstance(saved, dict) or set(saved) != set(_LAYOUT_KEYS) or saved == layout:
        write_json(out / LAYOUT, layout)
        return tplan, 1
    old, now = saved["micro_batch_tokens"], tplan.micro_batch_tokens
    split = 1
    while math.ceil(old / split) > now and split < MAX_SPLIT:
        split *= 2
    pieces = f", each cut into {split} pieces (this plan's micro-batches hold {now} tokens)" if split > 1 else ""
    reason = (f"resumed with the layout its checkpoints were trained with, {old} tokens x "
              f"{saved['gradient_accumulation_steps']} accumulation (this plan: {now} x "
              f"{tplan.gradient_accumulation_steps}), so each step trains the same rows{pieces}")
    return tplan.model_copy(update={**saved, "reasons": [*tplan.reasons, reason]}), split


# ---------------------------------------------------------------- attempts

_SIGNAL = re.compile(r"Signal \d+ \((SIG\w+)\) received")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt))(: .*)?$")
_NUMBERS = re.compile(r"0x[0-9a-f]+|\d{3,}")


def error_line(lines: list[str]) -> str:
    """The error a worker died of, comparable between attempts (PIDs and addresses blanked out). Where torchrun's
    summary names a root cause, that rank's signal, else the first exception printed (the launcher keeps it in
    the tail): the other ranks listed under its "Failures:" got torchrun's SIGTERM because that rank failed."""
    found, first, section, root_signal, root_exit = "", "", "", "", ""
    for line in lines:
        text = line.strip()
        if text == "Failures:" or text.startswith("Root Cause"):
            section = text
        if section.startswith("Root Cause") and (m := re.match(r"exitcode\s*: (-?\d+)", text)):
            root_exit = f"a rank exited with code {m.group(1)}"
        if m := _SIGNAL.search(text):
            found = f"killed by {m.group(1)}"
            if section.startswith("Root Cause"):
                root_signal = found
        elif (m := _EXCEPTION.match(re.sub(r"^\[rank\d+\]: ", "", text))) and "ChildFailedError" not in m.group(1):
            found, first = text, first or text
    if section.startswith("Root Cause"):
        found = root_signal or first or root_exit
    return _NUMBERS.sub("#", found)


def worker_error(exc: WorkerFailed) -> str:
    """What a failed worker died of: the signal that ended it (one CPU rank runs without torchrun, whose line would
    name it), else the error its output ends with."""
    if exc.returncode < 0:
        try:
            return f"killed by {signal.Signals(-exc.returncode).name}"
        except ValueError:
            pass
    return error_line(exc.tail.splitlines())


class AttemptLog:
    """attempts.json of one output directory, plus what the running attempt's ranks report."""

    def __init__(self, out: Path):
        self.path = out / "attempts.json"
        self.records: list[dict[str, Any]] = _read_json(self.path, [])
        self.ranks: dict[int, dict[str, Any]] = {}

    @property
    def current(self) -> dict[str, Any]:
        return self.records[-1]

    def begin(self, split: int, resumed_from: int | None) -> None:
        self.ranks = {}
        self.records.append({"attempt": len(self.records) + 1,
                             "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                             "outcome": "running", "micro_batch_split": split, "resumed_from": resumed_from,
                             "last_step": resumed_from, "tokens": 0, "train_seconds": 0.0, "error": ""})
        self._started = time.monotonic()
        self.save()

    def observe(self, event: dict[str, Any]) -> None:
        """A rank's `progress` event: tokens and seconds of this attempt so far (see runtime/lifecycle.py)."""
        if event.get("kind") != "progress":
            return
        self.ranks[int(event.get("rank", 0))] = event
        ranks = self.ranks.values()
        self.current.update(last_step=max(r["step"] for r in ranks), tokens=sum(r["tokens"] for r in ranks),
                            train_seconds=round(max(r["seconds"] for r in ranks), 2))
        for key in ("reserved_mb", "process_mb"):
            values = [r[key] for r in ranks if r.get(key) is not None]
            if values:
                self.current[f"peak_{key}"] = round(max(values), 1)
        self.save()

    def end(self, outcome: str, error: str = "") -> None:
        self.current.update(outcome=outcome, error=error, wall_seconds=round(time.monotonic() - self._started, 1))
        self.save()

    def repeats(self) -> bool:
        """The last two attempts failed with the same error from the same checkpoint: nothing changed."""
        if len(self.records) < 2:
            return False
        a, b = self.records[-2], self.records[-1]
        return (a["outcome"] == b["outcome"] == "crashed" and bool(b["error"]) and a["error"] == b["error"]
                and a["resumed_from"] == b["resumed_from"] and a["micro_batch_split"] == b["micro_batch_split"])

    def save(self) -> None:
        try:
            write_json(self.path, self.records)
        except OSError as exc:  # accounting must never be what stops training (e.g. a full disk)
            run_logger().warning("could not update %s: %s", self.path, exc)


def run_attempts(out: Path, limit: int, resume_point: Callable[[], int | None],
                 launch: Callable[[int, EventHandler], None], least_split: int = 1) -> None:
    """launch(split, on_event) until it succeeds; adapt after out-of-memory, record every attempt. Each micro-batch
    is cut into at least `least_split` pieces (kept_layout)."""
    log = AttemptLog(out)
    logger = run_logger()
    while True:
        split = max(current_split(out), min(least_split, limit))
        log.begin(split, resume_point())
        try:
            launch(split, log.observe)
        except WorkerOOM as oom:
            log.end("out of memory", oom.message)
            new = adapt_after_oom(out, oom, limit)
            logger.warning("out of memory with each micro-batch in %d piece(s): trying again at once with %d pieces "
                           "(%d times the planned gradient accumulation: same effective batch, same results)",
                           split, new, new)
            continue
        except WorkerInterrupted:
            log.end("interrupted")
            raise
        except WorkerFailed as exc:
            log.end("crashed", worker_error(exc))
            if log.repeats():
                raise RepeatedFailure(
                    f"training failed twice the same way from the same checkpoint ({log.current['error']}); not "
                    f"retrying unchanged: see {out / 'train.log'}") from exc
            raise
        except NotRetryable as exc:
            log.end("stopped", str(exc).splitlines()[0])
            raise
        except BaseException as exc:  # cancelled, SIGTERM/SIGINT, an error here
            log.end(f"stopped ({type(exc).__name__})")
            raise
        log.end("completed")
        return


def whole_run(out: Path, final: dict[str, Any]) -> dict[str, Any]:
    """The final attempt's result (train_metrics.json) with tokens, seconds and tokens/s over all attempts.

    The attempt that wrote `final` is the last record; earlier ones count as measured up to their last logged
    step (work after it was lost and done again, so it is real work too, just not measured)."""
    records = _read_json(out / "attempts.json", [])
    earlier = records[:-1] if records and records[-1]["outcome"] in ("running", "completed") else records
    tokens = final["train_tokens"] + sum(r["tokens"] for r in earlier)
    seconds = final["train_seconds"] + sum(r["train_seconds"] for r in earlier)
    process = records[-1].get("peak_process_mb") if records else None
    return {**final, "train_tokens": tokens, "train_seconds": round(seconds, 2),
            "tokens_per_second": round(tokens / seconds, 1) if seconds else 0.0,
            "last_attempt_tokens": final["train_tokens"], "last_attempt_seconds": final["train_seconds"],
            "last_attempt_tokens_per_second": final["tokens_per_second"],
            "peak_process_memory_mb": process, "attempts": records,
            "oom_adaptations": _read_json(out / "adapt.json", {}).get("history", [])}
