"""The fault suite, from outside the flow process: SIGTERM/SIGINT to a running CLI run, and several CLI runs started
in the same second on a fresh Prefect home (real processes, real Prefect server, real torchrun).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune_flows.config.schema import load_config
from conftest import child_env
from fault_support import device_slot, overrides, start_cli, training_in_progress
from flows.finetune import finetune
from finetune_flows.runtime.gpus import read_inventory
from finetune_flows.runtime.processes import tree
from finetune_flows.training.checkpoints import checkpoint_is_complete

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(shared_cache):
    return shared_cache / "faults"


# ---------------------------------------------------------------- the flow process stopped from outside


@pytest.fixture
def device_slots(prefect_server):
    """This host's device limits on the test server (one per GPU, and the CPU's), as `make deploy` creates them;
    removed afterwards."""
    from prefect.client.orchestration import get_client

    from finetune_flows.orchestration.concurrency import ensure_device_limits

    names = ensure_device_limits()
    yield names
    with get_client(sync_client=True) as client:
        for name in names:
            client.delete_global_concurrency_limit_by_name(name)


def stop_a_cli_run(cache: Path, tmp_path: Path, sig: int, slots: list[str], seed: int, **extra) -> tuple[list, int]:
    """Start a CLI run against the test server, signal the flow process once training runs, check that every
    process of the run is gone and every device slot free when the command exits, and that the ranks saved one
    checkpoint on the way out. Returns the run's overrides and that checkpoint's step.

    Each step sleeps 0.2 s first (an injected fault): the tiny model runs 60 steps in about a second, faster than
    the signal reaches the ranks, and a run that finishes first saves no stop checkpoint."""
    from prefect.settings import PREFECT_API_URL

    from finetune_flows.runtime.lifecycle import FAULTS_ENV

    env = {FAULTS_ENV: json.dumps({"step_seconds": 0.2})}

    args = overrides(cache, tmp_path / "runs", **{"train.max_steps": 60, "train.save_steps": 100,
                                                  "train.seed": seed, "hardware.stop_grace_seconds": 30, **extra})
    proc = start_cli(args, child_env(PREFECT_API_URL=PREFECT_API_URL.value(), **env), tmp_path / "cli.log")
    try:
        out, rank = training_in_progress(cache, seed, min_step=3, run=proc, log=tmp_path / "cli.log")
        members = tree(proc.pid)  # the flow process, torchrun, the ranks
        assert rank in members and len(members) >= 3, members
        assert sum(device_slot(n).active_slots for n in slots) >= 1
        stopped = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == 128 + sig, (tmp_path / "cli.log").read_text()[-3000:]
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [m for m in members if m.is_running()], "a process of the run outlived it"
    assert took < 30 + 15, f"stopping took {took:.0f} s, more than the grace period"  # 15 s: slack for a loaded box
    assert all(device_slot(n).active_slots == 0 for n in slots)
    log = (tmp_path / "cli.log").read_text()
    assert f"stopped by {signal.Signals(sig).name}" in log and "Traceback" not in log.split("stopped by")[-1]
    saved = [p for p in (out / "checkpoints").glob("checkpoint-*") if checkpoint_is_complete(p)]
    assert len(saved) == 1, "the ranks did not save a checkpoint when asked to stop"  # save_steps is 100
    step = int(saved[0].name.split("-")[1])
    assert json.loads((out / "attempts.json").read_text())[-1]["outcome"].startswith("stopped (")
    assert "received SIGTERM: saving a checkpoint" in (out / "train.log").read_text()
    assert not list((out / "ranks").glob("*.pid")), "a rank left its PID record behind"
    print(f"FAULT {signal.Signals(sig).name}: every process gone and the CLI exited {took:.1f} s after the signal; "
          f"checkpoint-{step}")
    return args, step


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_flow_process_stops_every_worker_frees_the_slot_and_the_next_run_resumes(
        cache, tmp_path, device_slots, sig):
    args, step = stop_a_cli_run(cache, tmp_path, sig, device_slots, seed=500 + sig)
    if sig == signal.SIGTERM:  # the next run resumes from that checkpoint and finishes
        result = finetune(load_config(None, args))
        assert result.train.resumed_from_step == step and result.train.steps == 60
        first, last = result.train.attempts[0], result.train.attempts[-1]
        assert first["tokens"] > 0 and result.train.train_tokens == first["tokens"] + last["tokens"] == (
            result.train.last_attempt_tokens + first["tokens"])


def test_a_rerun_after_a_sigkilled_flow_process_waits_for_its_ranks_to_finish_saving(prefect_server, cache, tmp_path):
    """SIGKILL to the flow process frees the adapter entry's lock at once, while its ranks, told by their parent-death
    signal, may still be saving a checkpoint there for up to hardware.stop_grace_seconds. A rerun must not train into
    the same checkpoints meanwhile: it waits for those ranks (held back here with SIGSTOP, as a slow save would hold
    them), then resumes from the checkpoint they saved."""
    from prefect.settings import PREFECT_API_URL

    from finetune_flows.runtime.lifecycle import FAULTS_ENV

    env = child_env(PREFECT_API_URL=PREFECT_API_URL.value(), **{FAULTS_ENV: json.dumps({"step_seconds": 0.2})})
    args = overrides(cache, tmp_path / "runs", **{"train.max_steps": 60, "train.save_steps": 100,
                                                  "train.seed": 520, "hardware.stop_grace_seconds": 30})
    first = start_cli(args, env, tmp_path / "first.log")
    second = None
    try:
        out, rank = training_in_progress(cache, 520, min_step=3, run=first, log=tmp_path / "first.log")
        workers = [m for m in tree(first.pid) if m.pid != first.pid]  # torchrun (or a fork), the ranks
        assert rank in workers, workers
        for m in workers:
            m.signal(signal.SIGSTOP)
        first.kill()
        first.wait(timeout=30)
        second = start_cli(args, env, tmp_path / "second.log")
        deadline = time.monotonic() + 300
        while "are still saving into it" not in (tmp_path / "second.log").read_text():
            assert second.poll() is None and time.monotonic() < deadline, (tmp_path / "second.log").read_text()[-3000:]
            time.sleep(0.5)
        assert "starting train worker" not in (tmp_path / "second.log").read_text()
    finally:
        for m in workers:
            m.signal(signal.SIGCONT)
        if first.poll() is None:
            first.kill()
    try:
        assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        if second.poll() is None:
            second.kill()
    assert not [m for m in workers if m.is_running()]
    log = (tmp_path / "second.log").read_text()
    assert "earlier attempt's workers exited after" in log
    saved = json.loads((out / "attempts.json").read_text())
    resumed = [a for a in saved if a.get("resumed_from")]
    assert resumed and resumed[-1]["resumed_from"] > 0, saved
    assert "received SIGTERM: saving a checkpoint" in (out / "train.log").read_text()


@pytest.mark.parametrize("how", ["ctrl-c", "SIGTERM"])
def test_a_stop_of_a_run_on_its_temporary_server_ends_it_at_once_with_no_error_from_prefect(cache, tmp_path, how):
    """A terminal's Ctrl-C signals the whole foreground group: the flow process, its workers and (without
    PREFECT_API_URL) the temporary Prefect server it started. The server must outlive the signal, or Prefect's
    clients report the stop to a server that is gone until the stop deadline ends the process. A supervisor's
    SIGTERM reaches the flow process alone."""
    from finetune_flows.runtime.lifecycle import FAULTS_ENV

    env = {k: v for k, v in child_env().items() if not k.startswith("PREFECT_")}
    env.update({"PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                FAULTS_ENV: json.dumps({"step_seconds": 0.2})})
    args = overrides(cache, tmp_path / "runs", **{"train.max_steps": 60, "train.save_steps": 100, "train.seed": 702,
                                                  "hardware.stop_grace_seconds": 30})
    log = tmp_path / "cli.log"
    proc = start_cli(args, env, log, own_group=True)
    try:
        training_in_progress(cache, 702, min_step=3, run=proc, log=log)
        members = tree(proc.pid)  # the flow process, the server, torchrun, the ranks
        stopped = time.monotonic()
        sig = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
        if how == "ctrl-c":
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        assert proc.wait(timeout=120) == 128 + sig, log.read_text()[-3000:]
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    print(f"FAULT {how} on the temporary server: the CLI exited {took:.1f} s after the signal")
    assert "did not finish stopping" not in text and "Unable to connect" not in text, text[-3000:]
    assert took < 20, f"stopping took {took:.0f} s"
    assert text.count(f"stopped by {sig.name}") == 1, text[-3000:]
    assert not [m for m in members if m.is_running()], "a process of the run outlived it"


@pytest.mark.parametrize("flow", ["finetune", "evaluate", "export"])
def test_a_ctrl_c_while_the_command_loads_its_libraries_ends_it_without_a_traceback(tmp_path, flow):
    """The first seconds of every command import Prefect, torch and transformers; a Ctrl-C then printed a whole
    KeyboardInterrupt traceback (or, raised inside pydantic, a PydanticSerializationError)."""
    env = {k: v for k, v in child_env().items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "home")
    args = ["--adapter", str(tmp_path)] if flow != "finetune" else []
    proc = subprocess.Popen([sys.executable, f"flows/{flow}.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, process_group=0,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal starts it
    time.sleep(1)  # Python is up; the libraries are loading (several seconds here)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in out + err, err[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not read_inventory(), reason="needs an NVIDIA GPU (NVML finds none)")
def test_sigterm_stops_every_gpu_rank_at_the_same_step_and_the_next_run_resumes(cache, tmp_path, device_slots):
    """On every GPU of the host (NCCL when there are two or more): the stop flag goes through NCCL's all-reduce.
    Not compiled: the signal must not land in a minutes-long compilation (the stop path is the subject;
    test_gpu.py trains compiled)."""
    args, step = stop_a_cli_run(cache, tmp_path, signal.SIGTERM, device_slots, seed=801,
                                **{"hardware.gpus": "auto", "train.compile": False})
    result = finetune(load_config(None, args))
    assert result.train.resumed_from_step == step and result.train.rank_steps == [60] * len(read_inventory())


# ---------------------------------------------------------------- several CLI runs at once on a fresh Prefect home


@pytest.fixture(scope="module")
def warm_cache(prefect_server, cache, tmp_path_factory):
    """Every step of the concurrent runs already in the cache, so they contend only for Prefect itself."""
    args = overrides(cache, tmp_path_factory.mktemp("warm-runs"), **{"train.seed": 601})
    finetune(load_config(None, args))
    return args


@pytest.mark.parametrize("n", [2])
def test_cli_runs_started_in_the_same_second_on_a_fresh_prefect_home_all_finish(warm_cache, tmp_path, n):
    env = {k: v for k, v in child_env().items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "fresh-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    started = time.monotonic()
    procs = [start_cli(warm_cache, env, tmp_path / f"cli-{i}.log") for i in range(n)]
    try:
        codes = [p.wait(timeout=900) for p in procs]
        print(f"FAULT {n} CLI runs at once on a fresh Prefect home: exit codes {codes} after "
              f"{time.monotonic() - started:.0f} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"cli-{i}.log").read_text() for i in range(n)]
    assert codes == [0] * n, "\n\n".join(log[-2500:] for log in logs)
    assert not any("Timed out while attempting to connect" in log for log in logs)
    run_dirs = {json.loads(line)["run_dir"] for log in logs for line in log.splitlines()
                if line.startswith('{"run_dir"')}
    assert len(run_dirs) == n and all((Path(d) / "summary.json").is_file() for d in run_dirs)
