"""The content-addressed store under the cache root: the pipeline's one cache layer.

An entry is a directory `<cache root>/<kind>/<key>` (the key is a fingerprint of everything that determines the
output). Its `manifest.json`, written last and atomically, lists each output file's size and sha256 and holds the
step's result as pydantic JSON; a record (a machine probe, a measurement) is an entry whose manifest holds it whole,
with no files beside it. On reuse the manifest is read and every file re-hashed before the entry is
trusted, unless the file's size, mtime, ctime, inode and device are those recorded when it was last hashed against
this very manifest (`<cache root>/.verified/<kind>--<key>.json`): any write through the file system changes its
ctime, which no user call can set back, and re-hashing a large checkpoint at every reuse costs seconds per step.
A missing, truncated or mismatching manifest means "not cached" (the log says why) and the step produces the entry
again. Results come back through `Model.model_validate_json`: nothing is ever unpickled.

One writer per entry: an exclusive `fcntl.flock` on `<cache root>/.locks/<kind>--<key>.lock`, held while the
entry is produced. The kernel releases it when the holder dies, so a crash never leaves a stale lock (on NFS this
needs working NFS locks: NFSv4, or lockd for v3). Lock files are never deleted (deleting one would let two
writers lock two different files). Callers that also need a device take the entry lock first, then the device
slot (finetune_flows/orchestration/concurrency.py), always in that order.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

from finetune_flows.orchestration.concurrency import MAX_WAIT_REPORT_SECONDS, WAIT_REPORT_SECONDS
from finetune_flows.files import write_atomic
from finetune_flows.logs import run_logger

MANIFEST = "manifest.json"
LOCKS = ".locks"
VERIFIED = ".verified"
FORMAT = 1
ENTRY_PLACEHOLDER = "@entry"  # stored results name their own files relative to the entry, wherever it lives
LOCK_POLL_SECONDS = 0.5

M = TypeVar("M", bound=BaseModel)


class StoreError(RuntimeError):
    """A step finished without producing the outputs its entry must hold."""


def file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def file_identity(path: Path) -> list[int]:
    """What changes whenever a file's bytes may have: size, mtime, ctime (set by the kernel on every write and on
    any change of the mtime), inode and device."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def hashed(path: Path) -> tuple[dict[str, Any], list[int] | None]:
    """The file's digest, and its identity if nothing changed it while it was read (else None)."""
    before = file_identity(path)
    digest = file_digest(path)
    return digest, before if file_identity(path) == before else None


def _relocate(value: Any, old: str, new: str) -> Any:
    """Rewrite path strings under `old` to be under `new` (recursively through lists and dicts)."""
    if isinstance(value, str) and (value == old or value.startswith(old + "/")):
        return new + value[len(old):]
    if isinstance(value, list):
        return [_relocate(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _relocate(v, old, new) for k, v in value.items()}
    return value


class Entry:
    """One (kind, key) directory of the store."""

    def __init__(self, cache_root: Path, kind: str, key: str):
        self.root = Path(cache_root)
        self.kind, self.key = kind, key
        self.path = self.root / kind / key
        self.manifest_path = self.path / MANIFEST
        self.lock_path = self.root / LOCKS / f"{kind}--{key}.lock"
        # held shared by the entry's workers while they live (runtime/lifecycle.py: hold_workers_lock), which may
        # outlive a killed producer: a training worker told to stop still saves a checkpoint into the entry
        self.workers_lock_path = self.root / LOCKS / f"{kind}--{key}.workers.lock"
        self.verified_path = self.root / VERIFIED / f"{kind}--{key}.json"

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.key}"

    # ------------------------------------------------------------ reading

    def problem(self) -> str | None:
        """Why this entry cannot be trusted, or None when its manifest and every file it lists check out."""
        if not self.manifest_path.is_file():
            return "no entry yet" if not self.path.exists() else "no manifest (an earlier attempt did not finish)"
        try:
            text = self.manifest_path.read_text()
            manifest = json.loads(text)
            files = manifest["files"]
            if manifest.get("format") != FORMAT or not isinstance(files, dict):
                return f"manifest format {manifest.get('format')!r} is not {FORMAT}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"manifest unreadable or truncated ({type(exc).__name__}: {exc})"
        known = self._verified(text)
        seen: dict[str, list[int]] = {}
        for rel, want in files.items():
            p = self.path / rel
            if not p.is_file():
                return f"{rel} is missing"
            if p.stat().st_size != want.get("size"):
                return f"{rel} has {p.stat().st_size} bytes, the manifest says {want.get('size')}"
            if known.get(rel) is not None and known[rel] == file_identity(p):
                seen[rel] = known[rel]
                continue
            digest, identity = hashed(p)
            if digest["sha256"] != want.get("sha256"):
                return f"{rel} does not match its sha256 in the manifest"
            if identity is not None:
                seen[rel] = identity
        if seen != known:
            self._record_verified(text, seen)
        return None

    def _verified(self, manifest_text: str) -> dict[str, list[int]]:
        """The identities of this manifest's files when they were last hashed and matched it ({} if none)."""
        try:
            record = json.loads(self.verified_path.read_text())
            if record.get("manifest") == hashlib.sha256(manifest_text.encode()).hexdigest():
                return {rel: v for rel, v in record["files"].items() if isinstance(v, list)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return {}

    def _record_verified(self, manifest_text: str, files: dict[str, list[int]]) -> None:
        """Remember which files matched this manifest, as they were: one writer at a time, under the record's own
        lock taken without waiting (a reader that finds it held leaves the writing to the holder; a record not
        written only costs the next reader a re-hash)."""
        record = {"manifest": hashlib.sha256(manifest_text.encode()).hexdigest(), "files": files}
        try:
            self.verified_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.verified_path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return
        try:
            if _try_lock(fd):
                write_atomic(self.verified_path, json.dumps(record))
        except OSError:
            pass
        finally:
            os.close(fd)

    def keep_verified(self, rel: str, change: Callable[[], None]) -> None:
        """Run `change`, which alters only the metadata of the entry's file `rel` (a hard link to it, a chmod): that
        sets its ctime, so the next reuse would hash it again (16 GB for an 8B checkpoint). When the file was
        verified just before and nothing but its ctime changed, its record is carried over to the new ctime."""
        path = self.path / rel
        try:
            text = self.manifest_path.read_text()
        except OSError:
            text = None
        before = file_identity(path)
        change()
        if text is None:
            return
        known = self._verified(text)
        after = file_identity(path)
        if known.get(rel) == before and after[:2] + after[3:] == before[:2] + before[3:] and after != before:
            self._record_verified(text, {**known, rel: after})

    def load(self, model: type[M], quiet: bool = False) -> M | None:
        """The verified result, or None (logging why the entry is not used, unless quiet)."""
        problem = self.problem()
        if problem is None:
            try:
                manifest = json.loads(self.manifest_path.read_text())
                result = _relocate(manifest["result"], ENTRY_PLACEHOLDER, str(self.path))
                return model.model_validate_json(json.dumps(result))
            except (OSError, ValueError, KeyError, ValidationError) as exc:
                problem = f"stored result does not validate as {model.__name__} ({exc})".splitlines()[0]
        if quiet:
            return None
        if problem == "no entry yet":
            run_logger().info("%s: not cached: %s", self.label, problem)
        elif not self.manifest_path.is_file() and self.being_produced():
            pass  # a live concurrent writer, not an abandoned attempt: lock() says at INFO that this run waits for it
        else:
            run_logger().warning("%s: not cached: %s", self.label, problem)
        return None

    def being_produced(self) -> bool:
        """Whether another writer holds the entry's lock right now (a probe: the lock is released at once)."""
        try:
            fd = os.open(self.lock_path, os.O_RDWR)
        except OSError:
            return False
        try:
            if not _try_lock(fd):
                return True
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)

    # ------------------------------------------------------------ writing (hold the lock)

    def commit(self, result: BaseModel, outputs: Sequence[str]) -> None:
        """Hash the outputs (files, or directories of files, relative to the entry; none for a record) and write the
        manifest last."""
        files: dict[str, Any] = {}
        identities: dict[str, list[int]] = {}
        for rel in outputs:
            p = self.path / rel
            if p.is_dir():
                found = sorted(f for f in p.rglob("*") if f.is_file() and f.name != MANIFEST)
            elif p.is_file():
                found = [p]
            else:
                raise StoreError(f"{self.label}: the step finished without writing {rel}")
            for f in found:
                name = str(f.relative_to(self.path))
                files[name], identity = hashed(f)
                if identity is not None:
                    identities[name] = identity
        if outputs and not files:
            raise StoreError(f"{self.label}: the step produced no files")
        stored = _relocate(result.model_dump(mode="json"), str(self.path), ENTRY_PLACEHOLDER)
        manifest = {"format": FORMAT, "kind": self.kind, "key": self.key,
                    "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "files": files, "result": stored}
        text = json.dumps(manifest, indent=1)
        write_atomic(self.manifest_path, text)
        self._record_verified(text, identities)

    def invalidate(self, keep: Sequence[str] = ()) -> None:
        """Remove the manifest first (so nothing half-rewritten is ever trusted), then everything not in `keep`."""
        self.manifest_path.unlink(missing_ok=True)
        if not self.path.is_dir():
            return
        for child in self.path.iterdir():
            if child.name in keep:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the entry's exclusive lock; while another process holds it, wait and say so."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _wait_for_lock(fd, lambda: f"waiting for {self.label}: another run is producing it "
                                       f"({_holder(self.lock_path)})",
                           lambda s: f"still waiting for {self.label}: {s:.0f} s so far ({_holder(self.lock_path)})",
                           lambda s: f"acquired the lock of {self.label} after waiting {s:.1f} s")
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}).encode(), 0)
            self._wait_for_workers()
            yield
        finally:
            os.close(fd)  # closing the only descriptor releases the flock

    def _wait_for_workers(self) -> None:
        """Wait until no worker of an earlier producer is left writing into the entry: the entry's lock dies with
        its holder, while a worker it started may still be saving (up to hardware.stop_grace_seconds)."""
        try:
            fd = os.open(self.workers_lock_path, os.O_RDWR)
        except FileNotFoundError:  # no producer of this entry started a worker that holds it
            return
        try:
            _wait_for_lock(fd, lambda: f"{self.label}: the workers of an earlier attempt whose run was stopped are "
                                       "still saving into it: waiting for them to exit",
                           lambda s: f"{self.label}: still waiting for an earlier attempt's workers to exit: "
                                     f"{s:.0f} s so far",
                           lambda s: f"{self.label}: the earlier attempt's workers exited after {s:.1f} s")
        finally:
            os.close(fd)


def _wait_for_lock(fd: int, waiting: Callable[[], str], still: Callable[[float], str],
                   done: Callable[[float], str]) -> None:
    """Take the exclusive flock on `fd`; where another holds it, say so, poll, and say so again at growing
    intervals (the messages: `waiting()`, `still(seconds)`, `done(seconds)`)."""
    if _try_lock(fd):
        return
    logger, started = run_logger(), time.monotonic()
    logger.info(waiting())
    report_at, interval = started + WAIT_REPORT_SECONDS, WAIT_REPORT_SECONDS
    while not _try_lock(fd):
        time.sleep(LOCK_POLL_SECONDS)
        if time.monotonic() >= report_at:
            logger.info(still(time.monotonic() - started))
            interval = min(2 * interval, MAX_WAIT_REPORT_SECONDS)
            report_at = time.monotonic() + interval
    logger.info(done(time.monotonic() - started))


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _holder(lock_path: Path) -> str:
    try:
        info = json.loads(lock_path.read_text())
        return f"held by pid {info['pid']} on {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def reuse_or_produce(entry: Entry, model: type[M], produce: Callable[[], M], outputs: Sequence[str],
                     keep: Sequence[str] = ()) -> tuple[M, bool]:
    """The verified entry, or produce it under the entry's lock. Returns (result, reused).

    Double-checked: a second identical run waits for the lock, finds the entry the first one committed, and
    reuses it. `produce` writes into `entry.path`; `keep` names what a new attempt keeps from an unfinished one
    (training keeps its checkpoints to resume from them).
    """
    found = entry.load(model)
    if found is not None:
        return found, True
    with entry.lock():
        found = entry.load(model, quiet=True)
        if found is not None:
            run_logger().info("%s: produced by another run while this one waited; reusing it", entry.label)
            return found, True
        entry.invalidate(keep)
        entry.path.mkdir(parents=True, exist_ok=True)
        result = produce()
        entry.commit(result, outputs)
        return result, False


def _commit_record(entry: Entry, result: BaseModel) -> None:
    entry.invalidate()
    entry.path.mkdir(parents=True, exist_ok=True)
    entry.commit(result, ())


def reuse_or_record(entries: Sequence[Entry], model: type[M],
                    produce: Callable[[list[Entry]], list[M]]) -> list[tuple[M, bool]]:
    """Records (results held whole in their manifests): each verified entry reused, the others produced together by
    one `produce(missing)` (one result per entry, in order) under their locks, taken in key order so two runs
    needing overlapping sets never wait on each other. Returns (result, reused) per entry, in order."""
    results: dict[int, tuple[M, bool]] = {}
    for i, entry in enumerate(entries):
        if (found := entry.load(model)) is not None:
            results[i] = (found, True)
    missing = [i for i in range(len(entries)) if i not in results]
    if missing:
        with ExitStack() as held:
            for i in sorted(missing, key=lambda i: entries[i].label):
                held.enter_context(entries[i].lock())
            for i in missing:  # double-checked, as in reuse_or_produce
                if (found := entries[i].load(model, quiet=True)) is not None:
                    results[i] = (found, True)
            todo = [i for i in missing if i not in results]
            if todo:
                for i, result in zip(todo, produce([entries[i] for i in todo]), strict=True):
                    _commit_record(entries[i], result)
                    results[i] = (result, False)
    return [results[i] for i in range(len(entries))]


def rewrite_record(entry: Entry, result: BaseModel) -> None:
    """Replace a record (the last measurement wins) under its lock; readers meanwhile find none, never a torn one."""
    with entry.lock():
        _commit_record(entry, result)


def step_state(result: M, reused: bool, entry: Entry):
    """What a step task returns: the result, or a Completed state named `Cached` (shown so in the Prefect UI)."""
    if not reused:
        return result
    from prefect.states import Completed

    return Completed(name="Cached", data=result, message=f"reused {entry.path} (manifest verified)")
