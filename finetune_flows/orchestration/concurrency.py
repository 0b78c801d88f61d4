"""Never two jobs on one device: quantization, training and evaluation hold a slot per device.

Slot names are `device-<host>-gpu<id>` for each selected GPU (nvidia-smi id), or `device-<host>-cpu` for CPU
runs. A GPU's slot is first a lock on this host (below): every run takes it, a plain CLI run too, whatever Prefect
server it talks to (a CLI run has a temporary one of its own, where no limit exists). Then, where the Prefect server
has a global concurrency limit of that name, a lease on it: `make deploy` and `make worker` create the limits of
their host, one slot each (`python -m finetune_flows.orchestration.concurrency`); the UI shows who holds a device,
and runs that do not share this host's /tmp (containers) still take turns. The CPU has only the Prefect limit: CLI
runs on the CPU do not wait for each other (a test suite runs many at once). A run that finds a device busy waits,
and says so in its log, naming who holds it, every `WAIT_REPORT_SECONDS` (doubling up to every 5 minutes); when a
limit does not exist, the step runs without a lease and says so once per process (not at all on the temporary
server of a plain CLI run). Slots guard devices, not outputs: one writer per output is the store's entry lock
(store/entries.py), always taken before the device slot. A holder that dies without releasing its slot (SIGKILL)
leaves a lease that would hold the slot for up to `LEASE_SECONDS`; its slot file on this host (below) lets the
next run release it as soon as the holder and its workers are gone.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from uuid import UUID

from finetune_flows.logs import run_logger
from finetune_flows.runtime.gpus import read_inventory
from finetune_flows.runtime.lifecycle import HELD_DEVICE_LOCKS
from finetune_flows.runtime.processes import ProcessId, start_time

WAIT_REPORT_SECONDS = 30.0
MAX_WAIT_REPORT_SECONDS = 300.0
LEASE_SECONDS = 300.0  # Prefect's default; renewed every 3/4 of it while held
POLL_SECONDS = 1.0  # how often a waiter asks again, and checks whether the holder is still alive
SLOT_PREFIX = "device-"


def host_label(host: str | None = None) -> str:
    return (host or socket.gethostname()).replace(".", "-")


def slot_names(gpu_ids: list[int], host: str | None = None) -> list[str]:
    host = host_label(host)
    return [f"{SLOT_PREFIX}{host}-gpu{i}" for i in gpu_ids] or [f"{SLOT_PREFIX}{host}-cpu"]


def host_slot_names(gpu_ids: list[int], host: str | None = None) -> list[str]:
    """Every device of a host: one slot per GPU plus the CPU slot (a `hardware.gpus=cpu` run uses it)."""
    return slot_names(gpu_ids, host) + (slot_names([], host) if gpu_ids else [])


def ensure_device_limits(gpu_ids: list[int] | None = None, host: str | None = None) -> list[str]:
    """Create this host's device limits with one slot each; an existing limit is set back to one slot.

    `gpu_ids` defaults to the GPUs NVML reports here. Safe to run again (`make deploy`, `make worker`).
    """
    from prefect.client.orchestration import get_client

    ids = [g.index for g in read_inventory()] if gpu_ids is None else gpu_ids
    names = host_slot_names(ids, host)
    with get_client(sync_client=True) as client:
        for name in names:
            client.upsert_global_concurrency_limit_by_name(name, limit=1)
    return names


def _existing_limits(names: list[str]) -> dict[str, Any]:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    found = {}
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                found[name] = client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                continue
    return found


_REPORTED_MISSING: set[str] = set()


def _temporary_server() -> bool:
    """No PREFECT_API_URL: Prefect started a temporary local server for this process alone."""
    from prefect.settings import PREFECT_API_URL

    return not PREFECT_API_URL.value()


def _lease_holder():
    """The task run holding the slot, recorded with the lease so the UI can show who has the device."""
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    return ConcurrencyLeaseHolder(type="task_run", id=ctx.task_run.id) if ctx else None


# ---------------------------------------------------------------- who holds a slot on this host
# A lease outlives a holder that dies without releasing it (SIGKILL, OOM killer, power loss of the flow process)
# until it expires, LEASE_SECONDS after its last renewal. Every slot name carries its host, so all who contend for
# a slot run on that host: the holder keeps a shared flock on the slot's file in SLOT_DIR (with its lease id and
# who it is), and so do its workers (DEVICE_LOCKS_ENV in runtime/lifecycle.py), which may outlive it by their stop
# grace. The kernel drops the lock when the last of them dies; a waiter that can take the lock exclusively knows
# the device is free and releases the dead holder's lease at once. Where the waiter cannot see the holder's file (a
# container with its own /tmp) it waits for the lease to expire, and says so.


def slot_dir() -> Path:
    return Path(tempfile.gettempdir()) / "finetune-flows-device-slots"


def _slot_file(name: str, limit_id: Any) -> Path:
    return slot_dir() / f"{name}.{limit_id}.lock"  # the limit's id: one file per server's limit, not per name


def _open_slot_file(path: Path, create: bool) -> int | None:
    """The slot file, shared by every user of the host (sticky directory, files everyone may lock); None where it
    cannot be opened."""
    try:
        if create:
            path.parent.mkdir(mode=0o1777, exist_ok=True)
            if path.parent.stat().st_uid == os.getuid():
                os.chmod(path.parent, 0o1777)
        fd = _open_or_create(path) if create else os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if create and os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o666)
    except OSError:
        pass
    return fd


def _open_or_create(path: Path) -> int:
    """Open the file, creating it only where it does not exist: with fs.protected_regular (systemd's default) an
    O_CREAT open of another user's file in a sticky directory is refused even where the file exists and is
    writable, and the run would go on without the lock."""
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        pass
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:  # another run created it meanwhile
        return os.open(path, os.O_RDWR)


def _read_record(fd: int) -> dict[str, Any]:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


def _write_record(fd: int, record: bytes) -> None:
    """Who holds a slot, in its file (read by waiters under the file's lock, _read_record)."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)


def _describe(record: dict[str, Any], held: bool = True) -> str:
    """Who a slot file's record names; with `held` (its lock is taken), whether that is the holder or its workers."""
    if not record:
        return "a run that has not recorded itself yet"
    who = f"flow run {record['flow_run_name']!r}" if record.get("flow_run_name") else "a process"
    where = f"pid {record.get('pid')} on {record.get('host')}"
    holder = ProcessId(record["pid"], record["start"]) if record.get("pid") and record.get("start") else None
    if held and holder and record.get("host") == socket.gethostname() and not holder.is_running():
        return f"the workers of {who} ({where}, which died: they are still stopping)"
    return f"{who} ({where})"


def _holder_or_reap(client, name: str, limit_id: Any, logger) -> str | None:
    """Who holds slot `name` as this host sees it, or None once a dead holder's lease has been released here."""
    fd = _open_slot_file(_slot_file(name, limit_id), create=False)
    if fd is None:
        return (f"held by a run this host has no record of (another container, or one killed as it took the slot): "
                f"its lease frees the slot at most {LEASE_SECONDS / 60:.0f} minutes after it stopped renewing it")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # the holder, or a worker of it, is alive
            return f"held by {_describe(_read_record(fd))}"
        record = _read_record(fd)
        if not record.get("lease_id"):
            return "held by a run that is taking the slot right now"
        try:
            client.release_concurrency_slots_with_lease(UUID(record["lease_id"]))  # a released lease: no-op
        except Exception as exc:  # the server is unreachable for now: the next poll tries again
            return f"held by {_describe(record, held=False)}, which died; releasing its lease failed ({exc})"
        os.ftruncate(fd, 0)
        logger.warning("device slot %s was held by %s, which died without releasing it (its workers are gone too): "
                       "released its lease instead of waiting up to %.0f s for it to expire", name,
                       _describe(record, held=False), LEASE_SECONDS)
        return None
    finally:
        os.close(fd)  # drops our lock, if we took it


class _Hold:
    """This process's hold on the slot files while it holds the lease (a shared flock on each, with the record)."""

    def __init__(self, limits: dict[str, Any], lease_id: UUID, logger):
        record = _record(lease_id)
        self.fds, self.paths = [], []
        for name, lim in limits.items():
            path = _slot_file(name, lim.id)
            fd = _open_slot_file(path, create=True)
            if fd is None:
                logger.warning("cannot write %s: a waiter for %s cannot tell if this run dies, and would wait for "
                               "its lease to expire", path, name)
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a waiter checks the file
            _write_record(fd, record)
            self.fds.append(fd)
            self.paths.append(str(path))

    def close(self) -> None:
        for fd in self.fds:
            os.ftruncate(fd, 0)  # the lease is released: nothing for a waiter to release
            os.close(fd)
        self.fds = []


def held_slot_files() -> tuple[str, ...]:
    """The slot files the device slots this task holds: its workers hold them too (launcher.worker_env)."""
    return HELD_DEVICE_LOCKS.get()


class _Lease:
    """A lease on device slots, as its renewer last saw it."""

    def __init__(self, lease_id: UUID, names: list[str]):
        self.id, self.names = lease_id, names
        self.taken = self.renewed = _clock()  # renewed: when the last renewal that succeeded was sent
        self.lost = False  # the server forgot the lease before it could expire: its slots are still counted


def _clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)  # counts a suspended host's sleep too, as the server's clock does


def _renew(lease: _Lease, stop: threading.Event, logger, label: str) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        interval = LEASE_SECONDS * 0.75
        while not stop.wait(interval):
            sent = _clock()
            try:
                client.renew_concurrency_lease(lease.id, LEASE_SECONDS)
                lease.renewed, interval = sent, LEASE_SECONDS * 0.75
            except Exception as exc:
                if getattr(getattr(exc, "response", None), "status_code", None) != 410:  # unreachable: retry soon
                    logger.warning("could not renew the lease on device slot(s) %s (%s): retrying in 10 s", label,
                                   exc)
                    interval = 10.0
                elif sent - lease.renewed < 0.95 * LEASE_SECONDS:  # gone before it could expire: a restarted server
                    lease.lost = True  # (leases in memory) still counts the slots: released by name at the end
                    logger.warning("the Prefect server lost the lease on device slot(s) %s (restarted?): holding "
                                   "them still, and releasing them by name at the end", label)
                    return
                else:  # expired: the server freed the slots already
                    logger.warning("the lease on device slot(s) %s expired (not renewed for %.0f s): the server may "
                                   "give them to another run", label, sent - lease.renewed)
                    return


def _try_acquire(client, names: list[str]):
    """The lease's id if every slot was free and is now ours, else None."""
    from prefect.exceptions import PrefectHTTPStatusError

    try:
        response = client.increment_concurrency_slots_with_lease(names, slots=1, mode="concurrency",
                                                                  lease_duration=LEASE_SECONDS,
                                                                  holder=_lease_holder())
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code == 423:  # locked: a slot is taken
            return None
        raise
    return UUID(response.json()["lease_id"])


# ---------------------------------------------------------------- a GPU's lock on this host
# Two files per GPU in SLOT_DIR, named by the slot and not by any server's limit: `<slot>.lock`, locked exclusively
# by the holding process alone, with its record (who holds the GPU); and `<slot>.workers.lock`, locked shared by the
# holder and its workers (DEVICE_LOCKS_ENV), which may outlive it by their stop grace. A worker started by a fork
# server cannot inherit the holder's descriptor, and a shared lock cannot sit beside the holder's exclusive one, hence
# the second file. A taker needs both files exclusively (no holder alive, none of its workers either), then keeps the
# workers' file shared: no other taker converts it meanwhile, as each needs the first file too.


def _host_lock_paths(name: str) -> tuple[Path, Path]:
    return slot_dir() / f"{name}.lock", slot_dir() / f"{name}.workers.lock"


def _record(lease_id: UUID | None = None) -> bytes:
    """Who holds a slot, written into its files: this process, its flow run and, with a Prefect slot, its lease."""
    from prefect.context import FlowRunContext

    flow_run = getattr(FlowRunContext.get(), "flow_run", None)
    return json.dumps({"lease_id": str(lease_id) if lease_id else None, "host": socket.gethostname(),
                       "pid": os.getpid(), "start": start_time(os.getpid()),
                       "flow_run": str(flow_run.id) if flow_run else None,
                       "flow_run_name": flow_run.name if flow_run else None, "since": time.time()}).encode()


class _HostLocks:
    """This process's hold on its GPUs' host locks; `busy` says who holds those it could not take (all or none)."""

    def __init__(self, names: list[str]):
        self.names, self.fds, self.workers_paths = names, [], []
        self.busy: dict[str, str] = {}

    def try_take(self) -> bool:
        fds, self.busy = [], {}
        for name in self.names:
            device_path, workers_path = _host_lock_paths(name)
            device = _open_slot_file(device_path, create=True)
            workers = _open_slot_file(workers_path, create=True)
            if device is None or workers is None:  # an unwritable /tmp: the Prefect slot, if any, still guards it
                for fd in (device, workers):
                    if fd is not None:
                        os.close(fd)
                continue
            fds += [device, workers]
            for fd in (device, workers):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # its holder is alive, or the workers of a dead one are
                    self.busy[name] = f"held by {_describe(_read_record(device))}"
                    break
        if self.busy:
            for fd in fds:
                os.close(fd)  # drops what we took: all or none, as the Prefect slots are taken
            return False
        record = _record()
        for device, workers in zip(fds[::2], fds[1::2]):
            _write_record(device, record)
            fcntl.flock(workers, fcntl.LOCK_SH)  # our workers take it shared too
        self.fds = fds
        self.workers_paths = [str(_host_lock_paths(n)[1]) for n in self.names]
        return True

    def close(self) -> None:
        for device, workers in zip(self.fds[::2], self.fds[1::2]):
            os.close(workers)  # first: the next taker checks it once it has the device file
            os.ftruncate(device, 0)
            os.close(device)
        self.fds = []


class _WaitReport:
    """The "waiting for device slot(s)" lines: at once, then every WAIT_REPORT_SECONDS, doubling up to 5 minutes."""

    def __init__(self, label: str, logger):
        self.label, self.logger = label, logger
        self.started = time.monotonic()
        self.report_at, self.interval = self.started, WAIT_REPORT_SECONDS

    def busy(self, held: dict[str, str]) -> None:
        if not held or time.monotonic() < self.report_at:
            return
        waited = time.monotonic() - self.started
        self.logger.info("waiting for device slot(s) %s%s: %s", self.label, f" ({waited:.0f} s so far)"
                         if waited >= 1 else "", "; ".join(f"{n} {why}" for n, why in held.items()))
        self.report_at = self.started + self.interval if self.report_at == self.started \
            else self.report_at + self.interval
        self.interval = min(2 * self.interval, MAX_WAIT_REPORT_SECONDS)

    @property
    def waited(self) -> bool:
        return self.report_at != self.started


@contextmanager
def device_slots(gpu_ids: list[int]) -> Iterator[None]:
    """Hold each device's slot for the duration of the block: its host lock (GPUs), then its Prefect limit's slot
    where the server has that limit; log the wait (for whom) and the hold."""
    logger = run_logger()
    names = slot_names(gpu_ids)
    wait = _WaitReport(", ".join(names), logger)
    host = _HostLocks(names if gpu_ids else [])
    while not host.try_take():  # before the Prefect slot: on this host that lease is then free, or a dead holder's
        wait.busy(host.busy)
        time.sleep(POLL_SECONDS)
    try:
        with _prefect_slots(names, wait, logger) as (limits, slot_files):
            token = HELD_DEVICE_LOCKS.set(tuple(host.workers_paths) + slot_files)
            held_since = time.monotonic()
            if limits or wait.waited:  # a CLI run that found the GPU free says nothing, as before
                logger.info("acquired device slot(s) %s after waiting %.1f s", wait.label, held_since - wait.started)
            try:
                yield
            finally:
                if limits or wait.waited:
                    logger.info("releasing device slot(s) %s after holding them %.1f s", wait.label,
                                time.monotonic() - held_since)
                HELD_DEVICE_LOCKS.reset(token)
    finally:
        host.close()


@contextmanager
def _prefect_slots(names: list[str], wait: _WaitReport, logger) -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    """A lease on one slot of each device's Prefect limit where the server has those limits: (the limits, the slot
    files this process and its workers lock); ({}, ()) where it has none."""
    from prefect.client.orchestration import get_client

    limits = _existing_limits(names)
    missing = [n for n in names if n not in limits and n not in _REPORTED_MISSING]
    if missing and not _temporary_server():  # a temporary server serves this one process: nothing to queue behind
        logger.info("no concurrency limit named %s on the Prefect server (`make deploy` creates them): %s",
                    ", ".join(missing), "CPU steps do not queue behind other runs" if missing[0].endswith("-cpu")
                    else "GPU steps queue only behind runs that share this host's /tmp, and the UI does not show "
                    "who holds a GPU")
    _REPORTED_MISSING.update(missing)  # said once per process, not on every device step
    if not limits:
        yield {}, ()
        return
    names = list(limits)
    label = ", ".join(names)
    with get_client(sync_client=True) as client:
        while (lease_id := _try_acquire(client, names)) is None:
            now = {n: client.read_global_concurrency_limit_by_name(n) for n in names}
            held = {n: _holder_or_reap(client, n, lim.id, logger) for n, lim in now.items()
                    if lim.active_slots >= lim.limit}
            held = {n: why for n, why in held.items() if why}
            wait.busy(held)
            time.sleep(POLL_SECONDS if held else 0.1)  # none held: just freed, or taken and released meanwhile
    lease = _Lease(lease_id, names)
    hold = _Hold(limits, lease_id, logger)
    stop = threading.Event()
    renewer = threading.Thread(target=_renew, args=(lease, stop, logger, label), daemon=True)
    renewer.start()
    try:
        yield limits, tuple(hold.paths)
    finally:
        stop.set()
        renewer.join(timeout=10)  # a renewal under way may yet find the lease lost
        try:
            with get_client(sync_client=True) as client:
                if lease.lost:  # releasing the lease would be a no-op, and the slots counted for ever
                    client.release_concurrency_slots(names, slots=1, occupancy_seconds=_clock() - lease.taken)
                else:
                    client.release_concurrency_slots_with_lease(lease_id)
        finally:
            hold.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Create this host's device concurrency limits (one slot each) "
                                                 "on the Prefect server at PREFECT_API_URL.")
    parser.add_argument("--gpus", help="comma-separated nvidia-smi ids (default: every GPU NVML reports; none "
                                       "means only the CPU slot)")
    parser.add_argument("--host", help="host name in the slot names (default: this host's)")
    args = parser.parse_args(argv)
    gpu_ids = None if args.gpus is None else [int(i) for i in args.gpus.replace("none", "").split(",") if i.strip()]
    for name in ensure_device_limits(gpu_ids, args.host):
        print(f"concurrency limit {name}: 1 slot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
