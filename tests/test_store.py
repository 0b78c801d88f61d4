"""The content-addressed store: manifests verified before reuse, one writer per entry, atomic writes."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from pydantic import BaseModel

from finetune_flows.store.entries import (
    MANIFEST, Entry, StoreError, reuse_or_produce, reuse_or_record, rewrite_record, write_atomic,
)


class Result(BaseModel):
    path: Path
    value: int


def produce_into(entry: Entry, value: int = 7, payload: bytes = b"weights") -> Result:
    (entry.path / "sub").mkdir(parents=True, exist_ok=True)
    (entry.path / "sub" / "weights.bin").write_bytes(payload)
    (entry.path / "result.json").write_text(json.dumps({"value": value}))
    return Result(path=entry.path / "sub" / "weights.bin", value=value)


def committed(tmp_path: Path, kind: str = "things", key: str = "k1") -> Entry:
    entry = Entry(tmp_path / "cache", kind, key)
    result, reused = reuse_or_produce(entry, Result, lambda: produce_into(entry), outputs=["sub", "result.json"])
    assert not reused and result.value == 7
    return entry


def test_write_atomic_replaces_whole_files_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "d" / "marker.json"
    write_atomic(target, "first")
    write_atomic(target, b"second")
    assert target.read_text() == "second"
    assert [p.name for p in target.parent.iterdir()] == ["marker.json"]


def test_committed_entry_is_reused_with_its_result(tmp_path):
    entry = committed(tmp_path)
    manifest = json.loads(entry.manifest_path.read_text())
    assert set(manifest["files"]) == {"sub/weights.bin", "result.json"}
    assert manifest["result"]["path"] == "@entry/sub/weights.bin"  # stored relative to the entry
    calls = []
    again, reused = reuse_or_produce(entry, Result, lambda: calls.append(1), outputs=["sub"])
    assert reused and calls == [] and again == Result(path=entry.path / "sub" / "weights.bin", value=7)


def test_a_moved_cache_hands_back_paths_under_its_new_location(tmp_path):
    committed(tmp_path)
    shutil.move(tmp_path / "cache", tmp_path / "moved")
    moved = Entry(tmp_path / "moved", "things", "k1")
    assert moved.load(Result).path == tmp_path / "moved" / "things" / "k1" / "sub" / "weights.bin"


def test_an_adapter_evaluated_from_a_moved_cache_is_not_said_to_have_another_base(tmp_path, caplog):
    """An adapter's config names its 4-bit base by path, in the cache that trained it; the same base (same key) in a
    copied or moved cache is the same base, and another key still is another."""
    from finetune_flows.evaluation.adapters import warn_if_other_base
    from finetune_flows.models.quantize import QuantizedModel

    (tmp_path / "adapter").mkdir()
    trained_on = tmp_path / "old-cache" / "quantized" / "54049a1e"
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(trained_on)}))

    def base(path: Path) -> QuantizedModel:
        return QuantizedModel(path=path, fingerprint=path.name, load_in_4bit=True, compute_dtype="float32",
                              memory_footprint_mb=1.0, linear4bit_layers=1, quantize_seconds=0.0)

    with caplog.at_level(logging.WARNING):
        warn_if_other_base(tmp_path / "adapter", base(tmp_path / "new-cache" / "quantized" / "54049a1e"))
        assert "the adapter was trained on" not in caplog.text
        warn_if_other_base(tmp_path / "adapter", base(tmp_path / "new-cache" / "quantized" / "ffffffff"))
    assert "the adapter was trained on" in caplog.text


@pytest.mark.parametrize("damage, reason", [
    (lambda e: e.manifest_path.write_text(e.manifest_path.read_text()[:40]), "manifest unreadable or truncated"),
    (lambda e: e.manifest_path.unlink(), "no manifest"),
    (lambda e: (e.path / "sub" / "weights.bin").unlink(), "sub/weights.bin is missing"),
    (lambda e: (e.path / "sub" / "weights.bin").write_bytes(b"weight"),
     "sub/weights.bin has 6 bytes, the manifest says 7"),
    (lambda e: (e.path / "sub" / "weights.bin").write_bytes(b"WEIGHTS"), "sub/weights.bin does not match its sha256"),
    (lambda e: overwrite_keeping_mtime(e.path / "sub" / "weights.bin", b"WEIGHTS"),
     "sub/weights.bin does not match its sha256"),
], ids=["truncated-manifest", "no-manifest", "missing-file", "truncated-file", "changed-bytes",
        "changed-bytes-same-mtime"])
def test_a_damaged_entry_is_not_trusted_and_is_produced_again(tmp_path, caplog, damage, reason):
    entry = committed(tmp_path)
    damage(entry)
    with caplog.at_level(logging.INFO):
        assert entry.load(Result) is None
    assert f"things/k1: not cached: {reason}" in caplog.text
    assert [r.levelno for r in caplog.records if "not cached" in r.getMessage()] == [logging.WARNING]
    result, reused = reuse_or_produce(entry, Result, lambda: produce_into(entry, value=8), outputs=["sub"])
    assert not reused and result.value == 8 and entry.problem() is None


def overwrite_keeping_mtime(path: Path, data: bytes) -> None:
    """New bytes of the same size with the old mtime put back: only the ctime, which the kernel sets, tells."""
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_files_unchanged_since_they_were_hashed_are_not_read_again(tmp_path, monkeypatch):
    """Re-hashing a 16 GB checkpoint took ~16 s at every reuse (each row of the training bench, each step of a run
    on an 8B model): a file whose size, mtime, ctime, inode and device are those it had when it was hashed against
    this manifest is trusted without reading it; any write, a moved cache or a new manifest hashes it again."""
    import finetune_flows.store.entries as entries

    entry = committed(tmp_path)
    reads: list[str] = []
    real = entries.file_digest
    monkeypatch.setattr(entries, "file_digest", lambda p: reads.append(p.name) or real(p))
    assert entry.load(Result).value == 7 and reads == []  # commit hashed them, and recorded as what
    os.utime(entry.path / "sub" / "weights.bin")  # a touch: same bytes, new mtime and ctime
    assert entry.load(Result).value == 7 and reads == ["weights.bin"]
    assert entry.load(Result).value == 7 and reads == ["weights.bin"]  # recorded again after that hash
    shutil.copytree(tmp_path / "cache", tmp_path / "copy", copy_function=shutil.copy2)  # mtimes kept, not inodes
    copy = Entry(tmp_path / "copy", "things", "k1")
    reads.clear()
    assert copy.load(Result).value == 7 and sorted(reads) == ["result.json", "weights.bin"]
    entry.manifest_path.write_text(entry.manifest_path.read_text().replace('"value": 7', '"value": 9'))
    reads.clear()
    assert entry.load(Result).value == 9 and sorted(reads) == ["result.json", "weights.bin"]


def test_a_step_that_wrote_nothing_is_not_committed(tmp_path):
    entry = Entry(tmp_path / "cache", "things", "k2")
    with pytest.raises(StoreError, match="finished without writing sub"):
        reuse_or_produce(entry, Result, lambda: Result(path=entry.path, value=1), outputs=["sub"])
    assert not entry.manifest_path.exists()


def test_a_new_attempt_keeps_only_what_it_resumes_from(tmp_path):
    entry = Entry(tmp_path / "cache", "adapters", "k")
    (entry.path / "checkpoints" / "checkpoint-5").mkdir(parents=True)
    (entry.path / "adapter").mkdir()
    (entry.path / "adapter" / "half-written").write_text("x")
    seen = {}

    def produce() -> Result:
        seen["kept"] = sorted(p.name for p in entry.path.iterdir())
        return produce_into(entry)

    reuse_or_produce(entry, Result, produce, outputs=["sub"], keep=("checkpoints",))
    assert seen["kept"] == ["checkpoints"]


class Probe(BaseModel):
    value: int


def test_records_are_entries_whose_manifest_holds_them_and_only_the_missing_are_produced(tmp_path):
    """Probes and measurements: one produce call for every missing record, each then committed with a manifest."""
    cache = tmp_path / "cache"
    a, b, c = (Entry(cache, "probes", key) for key in ("a", "b", "c"))
    assert reuse_or_record([b], Probe, lambda missing: [Probe(value=2)]) == [(Probe(value=2), False)]
    asked = []

    def produce(missing):
        asked.append([e.key for e in missing])
        return [Probe(value=ord(e.key)) for e in missing]

    got = reuse_or_record([a, b, c], Probe, produce)
    assert asked == [["a", "c"]] and got == [(Probe(value=97), False), (Probe(value=2), True), (Probe(value=99), False)]
    manifest = json.loads(a.manifest_path.read_text())
    assert (manifest["kind"], manifest["key"], manifest["files"]) == ("probes", "a", {})
    assert manifest["result"] == {"value": 97}
    assert os.listdir(a.path) == [MANIFEST] and a.problem() is None
    a.manifest_path.write_text(a.manifest_path.read_text()[:-20])  # torn: not reused
    assert reuse_or_record([a, b], Probe, produce) == [(Probe(value=97), False), (Probe(value=2), True)]
    rewrite_record(b, Probe(value=3))  # the last measurement wins
    assert b.load(Probe) == Probe(value=3) and b.problem() is None
    with pytest.raises(StoreError, match="produced no files"):  # a step that names outputs must still write some
        (c.path / "empty").mkdir()
        c.commit(Probe(value=1), ["empty"])


# ---------------------------------------------------------------- one writer per entry (real processes)


def _hold_lock(cache: str, ready: multiprocessing.Event, release: multiprocessing.Event) -> None:
    entry = Entry(Path(cache), "things", "k")
    with entry.lock():
        entry.path.mkdir(parents=True)  # as reuse_or_produce does before it produces: an entry without a manifest
        ready.set()
        release.wait(60)
        produce_into(entry, value=1)
        entry.commit(Result(path=entry.path / "sub" / "weights.bin", value=1), ["sub"])


def test_a_second_writer_waits_then_reuses_what_the_first_committed(tmp_path, caplog):
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path / "cache"), ready, release))
    holder.start()
    assert ready.wait(60)
    entry = Entry(tmp_path / "cache", "things", "k")
    calls = []
    threading.Timer(1.5, release.set).start()  # the holder finishes while we wait
    with caplog.at_level(logging.INFO):
        result, reused = reuse_or_produce(entry, Result, lambda: calls.append(1), outputs=["sub"])
    holder.join(60)
    assert reused and calls == [] and result.value == 1
    assert f"waiting for things/k: another run is producing it (held by pid {holder.pid}" in caplog.text
    assert "produced by another run while this one waited; reusing it" in caplog.text
    # waiting on a live writer is normal: no WARNING about an unfinished attempt (that is for an abandoned one)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def _hold_forever(cache: str, ready: multiprocessing.Event) -> None:
    with Entry(Path(cache), "things", "k").lock():
        ready.set()
        time.sleep(600)


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_forever, args=(str(tmp_path / "cache"), ready))
    holder.start()
    assert ready.wait(60)
    os.kill(holder.pid, signal.SIGKILL)  # no cleanup code runs: the kernel drops the flock
    holder.join(30)
    entry = Entry(tmp_path / "cache", "things", "k")
    started = time.monotonic()
    result, reused = reuse_or_produce(entry, Result, lambda: produce_into(entry), outputs=["sub"])
    assert not reused and result.value == 7 and time.monotonic() - started < 30
    assert (tmp_path / "cache" / ".locks" / "things--k.lock").exists()  # lock files stay; only the flock matters
    assert MANIFEST in os.listdir(entry.path)
