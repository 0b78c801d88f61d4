"""Device slots against a real Prefect server, with real flow processes killed by SIGKILL: a slot whose holder died
is free as soon as the holder and its workers are gone, not when the lease expires five minutes later. A GPU's slot
is also a lock on the host, so a plain CLI run (a temporary server of its own, without the limits) and a deployment
run take that GPU in turn."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import child_env

ROOT = Path(__file__).resolve().parent.parent

# A flow whose task holds this host's CPU slot (or the GPUs given); with a worker, it starts a child that holds the
# slot's files as a training worker does (lifecycle.worker_main), sleeps `worker_seconds`, then writes when it exits.
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
def hold(seconds, worker_seconds, worker_done, gpus):
    with device_slots(gpus):
        if worker_seconds:
            subprocess.Popen([sys.executable, "-c", WORKER, str(worker_seconds), worker_done],
                             env={**os.environ, DEVICE_LOCKS_ENV: os.pathsep.join(held_slot_files())})
        print("HOLDING", time.time(), flush=True)
        time.sleep(seconds)
        print("RELEASING", time.time(), flush=True)

@flow(name="slot-holder")
def holder(seconds: float, worker_seconds: float = 0, worker_done: str = "", gpus: list[int] = []):
    hold(seconds, worker_seconds, worker_done, gpus)

holder(float(sys.argv[1]), float(sys.argv[2]), sys.argv[3], [int(i) for i in sys.argv[4:]])
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


def start_holder(tmp_path: Path, tag: str, seconds: float, worker_seconds: float = 0, gpus: tuple[int, ...] = (),
                 **env: str) -> subprocess.Popen:
    from prefect.settings import PREFECT_API_URL

    script = tmp_path / "holder.py"
    script.write_text(FLOW)
    log = open(tmp_path / f"{tag}.log", "w")
    return subprocess.Popen([sys.executable, str(script), str(seconds), str(worker_seconds),
                             str(tmp_path / "worker.done"), *map(str, gpus)], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env=child_env(PREFECT_API_URL=PREFECT_API_URL.value(), **env))


def wait_holding(proc: subprocess.Popen, log: Path, timeout: float = 120, what: str = "HOLDING") -> float:
    """The time the flow process took the slot (time.time() as it printed it), or `what` else it printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith(f"{what} "):
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


# ---------------------------------------------------------------- a GPU: CLI runs and deployment runs take turns

FAKE_GPU = 97  # an id no real GPU has: the test needs none, and takes no real GPU's lock


@pytest.fixture
def gpu_slot(prefect_server, tmp_path, monkeypatch):
    """GPU FAKE_GPU's limit on the test server, as `make deploy` creates it on a GPU host; the host's lock files in
    tmp_path (TMPDIR for the children, slot_dir here), not among real runs' in /tmp."""
    from prefect.client.orchestration import get_client

    from finetune_flows.orchestration import concurrency

    monkeypatch.setattr(concurrency, "slot_dir", lambda: tmp_path / "finetune-flows-device-slots")
    name, _ = concurrency.ensure_device_limits(gpu_ids=[FAKE_GPU])
    yield name
    with get_client(sync_client=True) as client:
        for limit in concurrency.host_slot_names([FAKE_GPU]):
            client.delete_global_concurrency_limit_by_name(limit)


@contextmanager
def a_cli_run_holds(monkeypatch, gpus: list[int]):
    """device_slots as a plain CLI run takes it: its temporary Prefect server has no concurrency limits."""
    from finetune_flows.orchestration import concurrency

    with monkeypatch.context() as m:
        m.setattr(concurrency, "_existing_limits", lambda names: {})
        with concurrency.device_slots(gpus):
            yield


def test_a_cli_run_and_a_deployment_run_take_a_gpu_in_turn(gpu_slot, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="finetune_flows")
    deployment = start_holder(tmp_path, "deployment", 4, gpus=(FAKE_GPU,), TMPDIR=str(tmp_path))
    later = None
    try:
        wait_holding(deployment, tmp_path / "deployment.log")
        with a_cli_run_holds(monkeypatch, [FAKE_GPU]):  # waits for the deployment run
            cli_took = time.time()
            later = start_holder(tmp_path, "later", 0, gpus=(FAKE_GPU,), TMPDIR=str(tmp_path))
            deadline = time.monotonic() + 60  # ... and the next deployment run waits for the CLI run
            while "waiting for device slot(s)" not in (tmp_path / "later.log").read_text():
                assert later.poll() is None and time.monotonic() < deadline, (tmp_path / "later.log").read_text()
                time.sleep(0.2)
            cli_left = time.time()
        assert deployment.wait(timeout=60) == 0, (tmp_path / "deployment.log").read_text()[-3000:]
        later_took = wait_holding(later, tmp_path / "later.log", timeout=60)
        assert later.wait(timeout=60) == 0, (tmp_path / "later.log").read_text()[-3000:]
    finally:
        for p in (deployment, later):
            if p is not None and p.poll() is None:
                p.kill()
    deployment_left = wait_holding(deployment, tmp_path / "deployment.log", what="RELEASING")
    waits = [r.getMessage() for r in caplog.records if "waiting for device slot(s)" in r.getMessage()]
    later_log = (tmp_path / "later.log").read_text()
    print("GPU the CLI run took the GPU %.1f s after the deployment run released it, the next deployment run %.1f s "
          "after the CLI run:" % (cli_took - deployment_left, later_took - cli_left), *waits,
          *(line for line in later_log.splitlines() if "device slot" in line), sep="\n")
    assert cli_took >= deployment_left, "the CLI run took the GPU while a deployment run held it"
    assert waits and f"{gpu_slot} held by flow run" in waits[0], waits
    assert later_took >= cli_left, "a deployment run took the GPU while a CLI run held it"
    assert f"{gpu_slot} held by a process (pid {os.getpid()} " in later_log, later_log[-3000:]


def test_a_gpu_whose_holder_was_sigkilled_is_free_for_a_cli_run_once_its_workers_are_gone(
        gpu_slot, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="finetune_flows")
    first = start_holder(tmp_path, "first", 600, worker_seconds=5, gpus=(FAKE_GPU,), TMPDIR=str(tmp_path))
    try:
        wait_holding(first, tmp_path / "first.log")
        time.sleep(0.5)  # the worker holds the GPU's files
        first.kill()
        first.wait(timeout=30)
        with a_cli_run_holds(monkeypatch, [FAKE_GPU]):
            worker_gone = (tmp_path / "worker.done").exists()
    finally:
        if first.poll() is None:
            first.kill()
    waits = [r.getMessage() for r in caplog.records if "waiting for device slot(s)" in r.getMessage()]
    assert worker_gone, "the GPU was taken while a worker of its dead holder still held it"
    assert waits and "which died: they are still stopping" in waits[0], waits
