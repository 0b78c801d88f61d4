"""Stopping `make worker` while a deployment run trains (a supervisor's SIGTERM, a Ctrl-C): the run is stopped as a
cancel stops it, saving a checkpoint, and ends in a final state, so its device slot is free and a rerun resumes.

Before deployments/worker.py stopped its runs itself, Prefect's handling tore the worker down, the tether took the
flow process and its training worker with it mid-step (no checkpoint), and the run stayed Running on the server,
holding its slot until the lease expired.
"""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from fault_support import training_in_progress
from finetune_flows.runtime.lifecycle import FAULTS_ENV
from tests.deploy_support import demo_config, running_stack

pytestmark = pytest.mark.slow


def test_stopping_the_worker_stops_its_training_run_with_a_checkpoint_and_a_final_state(tmp_path):
    cache, runs = tmp_path / "cache", tmp_path / "runs"
    overrides = {"model.source": "generated:tiny-llama", "data.builtin_examples": 120, "data.max_length": 128,
                 "train.max_steps": 3000, "train.save_steps": 1000, "train.seed": 811, "hardware.gpus": "cpu",
                 "eval.max_samples": 4, "export.merge": False, "run.name": "stopped",
                 "run.output_dir": str(runs), "run.cache_dir": str(cache)}
    with running_stack(tmp_path, allow={"output_roots": [runs], "cache_roots": [cache]},
                       extra_env={FAULTS_ENV: json.dumps({"step_seconds": 0.2})}) as stack:
        run_id = stack.deployment_run("finetune/on-demand",
                                      config=demo_config([f"{k}={v}" for k, v in overrides.items()]))
        out, _ = training_in_progress(cache, 811, min_step=3)
        make = psutil.Process(stack.procs[-1].pid)
        [worker] = [p for p in make.children(recursive=True)  # not the tether, whose arguments name it too
                    if p.cmdline()[1:3] == ["-m", "deployments.worker"]]
        members = worker.children(recursive=True)  # the flow process, its fork server, the training worker
        stopped = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        stack.procs[-1].wait(timeout=150)
        took = time.monotonic() - stopped
        [run] = stack.wait_for([run_id], timeout=60).values()
    log = (tmp_path / "logs" / "worker.log").read_text()
    print(f"FAULT worker SIGTERM: make worker ended {took:.1f} s after the signal; the run {run.state.type.value}")
    assert "taking no new runs; stopping 1 running flow run(s) with SIGTERM" in log, log[-3000:]
    assert "[train] stopped on a signal at step" in log and "[train] error:" not in log, log[-3000:]
    assert run.state.type.value in ("CRASHED", "CANCELLED"), run.state
    assert list((out / "checkpoints").glob("checkpoint-*")), "the stopped training saved no checkpoint"
    _, alive = psutil.wait_procs(members, timeout=10)
    assert not [m for m in alive if running(m)], "a process of the run outlived the worker"
    assert took < 60


def running(process: psutil.Process) -> bool:
    """Not ended: an ended process may stay a zombie a moment, until its new parent reaps it."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
