"""Never two jobs on one device: quantization, training and evaluation hold a Prefect global-concurrency slot
per device.

Slot names are `device-<host>-gpu<id>` for each selected GPU (nvidia-smi id), or `device-<host>-cpu` for CPU
runs. `make deploy` and `make worker` create the limits of their host, one slot each
(`python -m finetune_flows.orchestration.concurrency`). A run that finds a device busy waits, and says so in its
log every `WAIT_REPORT_SECONDS` (doubling up to every 5 minutes); when a limit does not exist, the step runs
unguarded and says so once per process (not at all on the temporary server of a plain CLI run, where nothing else
runs). Slots guard devices, not outputs: one writer per output is the store's entry lock (store/entries.py),
always taken before the device slot.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from finetune_flows.logs import run_logger
from finetune_flows.runtime.gpus import read_inventory

WAIT_REPORT_SECONDS = 30.0
MAX_WAIT_REPORT_SECONDS = 300.0
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


def _report_waiting(done: threading.Event, logger, label: str, started: float) -> None:
    interval = WAIT_REPORT_SECONDS
    while not done.wait(interval):
        logger.info("still waiting for device slot(s) %s: %.0f s so far (another run holds the device, or a run "
                    "that was killed does until its lease expires, about five minutes)", label,
                    time.monotonic() - started)
        interval = min(2 * interval, MAX_WAIT_REPORT_SECONDS)


@contextmanager
def device_slots(gpu_ids: list[int]) -> Iterator[None]:
    """Hold one slot of each device's limit for the duration of the block; log the wait and the hold."""
    from prefect.concurrency.sync import concurrency

    logger = run_logger()
    limits = _existing_limits(slot_names(gpu_ids))
    missing = [n for n in slot_names(gpu_ids) if n not in limits and n not in _REPORTED_MISSING]
    if missing and not _temporary_server():  # a temporary server serves this one process: nothing to queue behind
        logger.info("no concurrency limit named %s on the Prefect server (`make deploy` creates them): device "
                    "steps do not queue behind other runs on that device", ", ".join(missing))
    _REPORTED_MISSING.update(missing)  # said once per process, not on every device step
    if not limits:
        yield
        return
    names = list(limits)
    label = ", ".join(names)
    busy = [n for n, lim in limits.items() if lim.active_slots >= lim.limit]
    logger.info("waiting for device slot(s) %s%s", label, f" ({', '.join(busy)} busy)" if busy else "")
    started = time.monotonic()
    acquired = threading.Event()
    threading.Thread(target=_report_waiting, args=(acquired, logger, label, started), daemon=True).start()
    try:
        with concurrency(names, occupy=1, strict=True, holder=_lease_holder(), raise_on_lease_renewal_failure=False):
            acquired.set()
            held = time.monotonic()
            logger.info("acquired device slot(s) %s after waiting %.1f s", label, held - started)
            try:
                yield
            finally:
                logger.info("releasing device slot(s) %s after holding them %.1f s", label, time.monotonic() - held)
    finally:
        acquired.set()


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
