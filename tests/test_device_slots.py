"""Device slots against a real Prefect server, with real flow processes killed by SIGKILL: a slot whose holder died
is free as soon as the holder and its workers are gone, not when the lease expires five minutes later."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import child_env

ROOT = Path(__file__).resolve().parent.parent

# A flow whose task holds this host's CPU slot; with a worker, it starts a child that holds the slot's file as a
# training worker does (lifecycle.worker_main), sleeps `worker_seconds`, then writes when it exits.
FLOW = """
import os, subprocess, sys, time
from prefect import flow, task
from finetune_flows.orchestration.concurrency import device_slots, held_slot_files
from finetune_flows.runtime.lifecycle import DEVICE_LOCKS_ENV

WORKER = ("import os, sys, time\\n"
          "from finetune_flows.runtime.lifecycle import DEVICE_LOCKS_ENV, hold_workers_lock\\n"
          "[hold_workers_lock(p) for p in os.environ[DEVICE_LOCKS_ENV].split(os.pathsep)]\\n"
          "time.sleep(float(sys.argv[1])); open(sys.argv[2], 'w').write(repr(time.time()))\\n")

@task
def hold(seconds, worker_seconds, worker_done):
    with device_slots([]):
        if worker_seconds:
            subprocess.Popen([sys.executable, "-c", WORKER, str(worker_seconds), worker_done],
                             env={**os.environ, DEVICE_LOCKS_ENV: os.pathsep.join(held_slot_files())})
        print("HOLDING", time.time(), flush=True)
        time.sleep(seconds)

@flow(name="slot-holder")
def holder(seconds: float, worker_seconds: float = 0, worker_done: str = ""):
    hold(seconds, worker_seconds, worker_done)

holder(float(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
"""


@pytest.fixture
def cpu_slot(prefect_server):
    """This host's CPU device limit on the test server, as `make deploy` creates it; removed afterwards."""
    from prefect.client.orchestration import get_client

    from finetune_flows.orchestration.concurrency import ensure_device_limits

    (name,) = ensure_device_limits(gpu_ids=[])
    yield name
    with get_client(sync_client=True) as client:
        client.delete_global_concurrency_limit_by_name(name)


def start_holder(tmp_path: Path, tag: str, seconds: float, worker_seconds: float = 0) -> subprocess.Popen:
    from prefect.settings import PREFECT_API_URL

    script = tmp_path / "holder.py"
    script.write_text(FLOW)
    log = open(tmp_path / f"{tag}.log", "w")
    return subprocess.Popen([sys.executable, str(script), str(seconds), str(worker_seconds),
                             str(tmp_path / "worker.done")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=child_env(PREFECT_API_URL=PREFECT_API_URL.value()))


def wait_holding(proc: subprocess.Popen, log: Path, timeout: float = 120) -> float:
    """The time the flow process took the slot (time.time() as it printed it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("HOLDING "):
                return float(line.split()[1])
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise TimeoutError(log.read_text()[-3000:])


@pytest.mark.parametrize("worker", [False, True], ids=["alone", "with-a-worker"])
def test_a_slot_whose_holder_was_sigkilled_is_free_once_it_and_its_workers_are_gone(cpu_slot, tmp_path, worker):
    first = start_holder(tmp_path, "first", 600, worker_seconds=6 if worker else 0)
    second = None
    try:
        wait_holding(first, tmp_path / "first.log")
        first.kill()
        first.wait(timeout=30)
        killed = time.time()
        second = start_holder(tmp_path, "second", 0)
        acquired = wait_holding(second, tmp_path / "second.log", timeout=60)
        assert second.wait(timeout=60) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
    log = (tmp_path / "second.log").read_text()
    print(f"SLOT the next run took the slot {acquired - killed:.1f} s after the SIGKILL of its holder:",
          *(line for line in log.splitlines() if "device slot" in line), sep="\n")
    assert acquired - killed < 20, log[-3000:]  # its lease alone would hold the slot for 300 s
    assert "died without releasing it" in log and "flow run" in log, log[-3000:]
    if worker:  # the worker outlived its flow process: the device was not free before it exited
        done = float((tmp_path / "worker.done").read_text())
        assert acquired >= done, f"the slot was taken {done - acquired:.1f} s before the worker holding it exited"
        assert "which died: they are still stopping" in log, log[-3000:]
