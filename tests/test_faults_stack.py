"""The fault suite against deployments on a real stack (server, `make deploy`, `make worker`): cancellation through
the API during training, and a server restart during training.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from fault_support import overrides, training_in_progress
from finetune_flows.runtime.lifecycle import FAULTS_ENV
from finetune_flows.runtime.processes import ProcessId, parent_of, wait_gone
from finetune_flows.training.checkpoints import checkpoint_is_complete
from tests.deploy_support import demo_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(shared_cache):
    return shared_cache / "faults"


# ---------------------------------------------------------------- deployments: cancel through the API, server restart


@pytest.fixture(scope="module")
def stack(tmp_path_factory, shared_cache):
    """A real server, `make deploy` (work pool, this host's device limits, deployments) and `make worker`. Each
    training step takes at least 0.2 s (the injected `step_seconds`), so a run is still training when the cancel or
    the restart lands: on a quiet host the tiny model's 60 steps took less than the cancel's way to the ranks."""
    from tests.deploy_support import running_stack

    base = tmp_path_factory.getbasetemp()  # its deployment runs write outputs in temporary directories
    roots = {"output_roots": [base], "cache_roots": [base, shared_cache], "config_roots": [base], "data_roots": [base]}
    with running_stack(tmp_path_factory.mktemp("fault-stack"), allow=roots,
                       extra_env={FAULTS_ENV: json.dumps({"step_seconds": 0.2})}) as s:
        yield s


def run_processes(rank: ProcessId) -> list[ProcessId]:
    """The rank, torchrun above it, and the flow-run process above that."""
    chain = [rank.pid]
    for _ in range(2):
        chain.append(parent_of(chain[-1]))
    return [ident for pid in chain if pid and (ident := ProcessId.of(pid))]


def stack_slot(stack) -> int:
    from finetune_flows.orchestration.concurrency import slot_names

    with stack.client() as client:
        return client.read_global_concurrency_limit_by_name(slot_names([])[0]).active_slots


def finished_state(stack, run_id: str, timeout: float = 900) -> str:
    return stack.wait_for([run_id], timeout=timeout)[run_id].state.type.value


def deployment_training(stack, cache: Path, tmp_path: Path, seed: int, save_steps: int):
    """An on-demand deployment run of 60 steps, returned once it trains: (overrides, flow run id, output, rank 0)."""
    args = overrides(cache, tmp_path / "runs", **{"train.max_steps": 60, "train.save_steps": save_steps,
                                                  "train.seed": seed, "hardware.gpus": "cpu"})
    run_id = stack.deployment_run("finetune/on-demand", config=demo_config(args))
    return (args, run_id, *training_in_progress(cache, seed, min_step=3))


def test_cancel_through_the_api_stops_every_worker_frees_the_slot_and_the_next_run_resumes(stack, cache, tmp_path):
    args, run_id, out, rank = deployment_training(stack, cache, tmp_path, seed=701, save_steps=100)
    members = run_processes(rank)
    assert len(members) == 3 and stack_slot(stack) == 1
    cancelled = time.monotonic()
    stack.run([str(Path(sys.executable).parent / "prefect"), "flow-run", "cancel", run_id])
    assert wait_gone(members, 30 + 30), f"processes of the cancelled run still there: {members}"
    took = time.monotonic() - cancelled
    assert finished_state(stack, run_id) == "CANCELLED"
    assert stack_slot(stack) == 0
    (saved,) = [p for p in (out / "checkpoints").glob("checkpoint-*") if checkpoint_is_complete(p)]
    step = int(saved.name.split("-")[1])
    print(f"FAULT cancel via API: all processes gone {took:.1f} s after `prefect flow-run cancel`; checkpoint-{step}")

    again = stack.deployment_run("finetune/on-demand", config=demo_config(args))
    assert finished_state(stack, again) == "COMPLETED", stack.logs_of(again)[-20:]
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["resumed_from_step"] == step and metrics["steps"] == 60


def test_a_server_restart_during_training_the_run_finishes_or_resumes(stack, cache, tmp_path):
    args, run_id, out, _ = deployment_training(stack, cache, tmp_path, seed=702, save_steps=10)
    stack.restart_server(down_seconds=10)
    state = finished_state(stack, run_id)
    if state != "COMPLETED":  # the run could not report to the server: the next one must pick up its checkpoints
        again = stack.deployment_run("finetune/on-demand", config=demo_config(args))
        assert finished_state(stack, again) == "COMPLETED", stack.logs_of(again)[-20:]
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["steps"] == 60
    print(f"FAULT server restart: first run {state}; resumed_from_step={metrics['resumed_from_step']}")
