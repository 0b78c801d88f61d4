"""finetune_flows/files.py: the one atomic write that every done-marker, result and report goes through."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from finetune_flows.files import write_json

REPO = Path(__file__).resolve().parent.parent
SIZE = 32 << 20  # large enough that a kill lands inside a write, most of the time


def test_a_process_killed_while_writing_leaves_the_former_file_whole(tmp_path):
    """SIGKILL (no handler runs) in the middle of rewriting a file: what is on disk is one whole former version."""
    target = tmp_path / "result.json"
    child = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys; from pathlib import Path; from finetune_flows.files import write_atomic\n"
            f"p = Path({str(target)!r}); i = 0\n"
            "while True:\n"
            f"    write_atomic(p, bytes([97 + i % 26]) * {SIZE}); i += 1\n"
            "    if i == 2: print('written', flush=True)\n")],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "written"
        time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    data = target.read_bytes()
    assert len(data) == SIZE and data == data[:1] * SIZE
    # the temp file a kill leaves is hidden beside it, never in the target's place
    assert all(p.name.startswith(".result.json.") for p in tmp_path.iterdir() if p != target)


def test_concurrent_writers_of_one_path_never_trip_on_each_others_temp_file(tmp_path):
    target = tmp_path / "summary.json"
    errors: list[BaseException] = []

    def writer(tag: str) -> None:
        try:
            for i in range(200):
                write_json(target, {"writer": tag, "i": i})
        except BaseException as exc:  # collected: a thread's exception would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(target.read_text())["i"] == 199
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_failed_write_keeps_the_former_file_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "attempts.json"
    write_json(target, [1])

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_json(target, [1, 2])
    assert json.loads(target.read_text()) == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["attempts.json"]
