"""The fault suite: each fault injected for real into the real pipeline (tiny generated model, CPU, real Prefect,
real torchrun), and the outcome checked. The README's fault table lists them.

Faults inside the training ranks are injected through FINETUNE_FLOWS_FAULTS (tasks/lifecycle.py: a real
torch.OutOfMemoryError, a real SIGKILL); faults from outside (signals to the flow process, cancellation through the
API, a server restart, a full disk, concurrent starts) are done to real processes from here.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tiny_overrides
from flows.finetune import finetune
from tasks.errors import DiskFull
from tasks.gpus import read_inventory
from tasks.lifecycle import FAULTS_ENV
from tasks.processes import ProcessId, parent_of, read_record, tree, wait_gone
from tasks.train_worker import checkpoint_is_complete

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def overrides(cache, runs, **extra):
    """Short runs that checkpoint every 2 steps and evaluate on 4 rows; each test its own seed (its own adapter)."""
    return tiny_overrides(cache, runs, **{"train.max_steps": 8, "train.save_steps": 2, "train.save_total_limit": 10,
                                          "train.logging_steps": 1, "eval.max_samples": 4, **extra})


@pytest.fixture(scope="module")
def cache(shared_cache):
    return shared_cache / "faults"


# ---------------------------------------------------------------- inside the ranks


@pytest.mark.parametrize("seed,ranks", [(1, 1), (5, 2)])
def test_rank_sigkilled_at_a_random_step_resumes_to_the_same_final_step(prefect_server, cache, tmp_path, monkeypatch,
                                                                       seed, ranks):
    rng = random.Random(seed)
    step, victim = rng.randint(2, 7), rng.randrange(ranks)
    marker = tmp_path / "killed"
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"sigkill_at_step": step, "sigkill_rank": victim, "once": str(marker)}))
    result = finetune(None, overrides(cache, tmp_path / "runs", **{
        "train.seed": 100 + seed, "train.retries": 1, "hardware.cpu_processes": ranks}))
    assert marker.exists(), "the rank was never killed"
    train = result.train
    checkpoint = 2 * ((step - 1) // 2) or None  # the last one saved before the step the rank died in
    assert train.resumed_from_step == checkpoint
    assert train.steps == 8 and train.rank_steps == [8] * ranks
    assert [a["outcome"] for a in train.attempts] == ["crashed", "completed"]
    assert train.attempts[0]["error"] == "killed by SIGKILL"
    assert train.loss_curve[-1][0] == 8
    print(f"FAULT SIGKILL seed {seed}: rank {victim} of {ranks} killed before step {step}, resumed from step "
          f"{checkpoint}, finished {train.steps} steps")


def test_out_of_memory_halves_the_micro_batch_and_finishes(prefect_server, cache, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"oom_at_step": 3, "oom_below_split": 2}))
    result = finetune(None, overrides(cache, tmp_path / "runs", **{"train.seed": 201, "train.retries": 0}))
    train = result.train
    assert train.steps == 8 and train.micro_batch_split == 2
    assert [a["outcome"] for a in train.attempts] == ["out of memory", "completed"]
    assert [(a["split"], a["new_split"]) for a in train.oom_adaptations] == [(1, 2)]
    assert "CUDA out of memory (injected before step 3" in train.oom_adaptations[0]["message"]
    assert train.resumed_from_step == 2  # the attempt that ran out of memory had saved checkpoint-2
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["train"]["oom_adaptations"] and summary["train"]["micro_batch_split"] == 2
    print(f"FAULT OOM at step 3: split 1 -> 2, resumed from step {train.resumed_from_step}, {train.steps} steps")


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 1.2 MB tmpfs: room for two checkpoints of the tiny model (~470 KB each), not three."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)]
                                           ).returncode != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (CI runs as root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_full_disk_while_saving_a_checkpoint_is_one_clear_error_and_loses_nothing(prefect_server, cache, tmp_path,
                                                                                  small_disk):
    own = tmp_path / "cache"  # the shared models, dataset and 4-bit base, but adapters on the small disk
    own.mkdir()
    for name in ("models", "tokenizers", "datasets", "quantized"):
        (cache / name).mkdir(parents=True, exist_ok=True)
        (own / name).symlink_to(cache / name)
    (own / "adapters").symlink_to(small_disk)
    earlier = small_disk / "written-before.bin"
    earlier.write_bytes(os.urandom(2**16))
    before = earlier.read_bytes()
    args = overrides(own, tmp_path / "runs", **{"train.seed": 401, "train.retries": 2})

    with pytest.raises(DiskFull) as info:
        finetune(None, args)
    message = str(info.value)
    assert "no space left on the device" in message and "\n" not in message, message
    print(f"FAULT full disk: {message}")
    (out,) = [p for p in small_disk.iterdir() if p.is_dir()]
    saved = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("checkpoint-*")
                   if checkpoint_is_complete(p))
    assert saved[:2] == [2, 4], saved  # what was saved before the disk filled up is whole
    assert earlier.read_bytes() == before
    attempts = json.loads((out / "attempts.json").read_text())
    assert len(attempts) == 1, "a full disk was retried"

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    result = finetune(None, args)
    assert result.train.resumed_from_step == saved[-1] and result.train.steps == 8


# ---------------------------------------------------------------- the flow process stopped from outside


def cli_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **extra}


def start_cli(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`python flows/finetune.py` on the defaults plus `args`, as the in-process `finetune(None, args)` runs it."""
    defaults = log.parent / "defaults.yaml"
    defaults.write_text("{}\n")
    argv = [sys.executable, "flows/finetune.py", "--config", str(defaults), *(x for a in args for x in ("--set", a))]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def training_in_progress(cache: Path, seed: int, min_step: int, timeout: float = 600) -> tuple[Path, ProcessId]:
    """The adapter directory of the run trained with `seed`, once its rank 0 runs and has passed min_step."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for job in cache.glob("adapters/*/train.job.json"):
            out = job.parent
            try:
                same = json.loads(job.read_text())["config"]["train"]["seed"] == seed
                attempt = json.loads((out / "attempts.json").read_text())[-1]
            except (OSError, ValueError, KeyError, IndexError):
                continue
            rank = read_record(out / "ranks" / "rank-0.pid")
            if same and rank and attempt["outcome"] == "running" and (attempt["last_step"] or 0) >= min_step:
                return out, rank
        time.sleep(0.2)
    raise TimeoutError(f"no training with seed {seed} reached step {min_step}")


def device_slot(name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name)


@pytest.fixture
def device_slots(prefect_server):
    """This host's device limits on the test server (one per GPU, and the CPU's), as `make deploy` creates them;
    removed afterwards."""
    from prefect.client.orchestration import get_client

    from tasks.concurrency import ensure_device_limits

    names = ensure_device_limits()
    yield names
    with get_client(sync_client=True) as client:
        for name in names:
            client.delete_global_concurrency_limit_by_name(name)


def stop_a_cli_run(cache: Path, tmp_path: Path, sig: int, slots: list[str], seed: int, **extra) -> tuple[list, int]:
    """Start a CLI run against the test server, signal the flow process once training runs, check that every
    process of the run is gone and every device slot free when the command exits, and that the ranks saved one
    checkpoint on the way out. Returns the run's overrides and that checkpoint's step."""
    from prefect.settings import PREFECT_API_URL

    args = overrides(cache, tmp_path / "runs", **{"train.max_steps": 60, "train.save_steps": 100,
                                                  "train.seed": seed, "hardware.stop_grace_seconds": 30, **extra})
    proc = start_cli(args, cli_env(PREFECT_API_URL=PREFECT_API_URL.value()), tmp_path / "cli.log")
    try:
        out, rank = training_in_progress(cache, seed, min_step=3)
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
        result = finetune(None, args)
        assert result.train.resumed_from_step == step and result.train.steps == 60
        first, last = result.train.attempts[0], result.train.attempts[-1]
        assert first["tokens"] > 0 and result.train.train_tokens == first["tokens"] + last["tokens"] == (
            result.train.last_attempt_tokens + first["tokens"])


@pytest.mark.gpu
@pytest.mark.skipif(not read_inventory(), reason="needs an NVIDIA GPU (NVML finds none)")
def test_sigterm_stops_every_gpu_rank_at_the_same_step_and_the_next_run_resumes(cache, tmp_path, device_slots):
    """On every GPU of the host (NCCL when there are two or more): the stop flag goes through NCCL's all-reduce."""
    args, step = stop_a_cli_run(cache, tmp_path, signal.SIGTERM, device_slots, seed=801, **{"hardware.gpus": "auto"})
    result = finetune(None, args)
    assert result.train.resumed_from_step == step and result.train.rank_steps == [60] * len(read_inventory())


# ---------------------------------------------------------------- several CLI runs at once on a fresh Prefect home


@pytest.fixture(scope="module")
def warm_cache(prefect_server, cache, tmp_path_factory):
    """Every step of the concurrent runs already in the cache, so they contend only for Prefect itself."""
    args = overrides(cache, tmp_path_factory.mktemp("warm-runs"), **{"train.seed": 601})
    finetune(None, args)
    return args


@pytest.mark.parametrize("n", [2, 4])
def test_cli_runs_started_in_the_same_second_on_a_fresh_prefect_home_all_finish(warm_cache, tmp_path, n):
    env = {k: v for k, v in cli_env().items() if not k.startswith("PREFECT_")}
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


# ---------------------------------------------------------------- deployments: cancel through the API, server restart


@pytest.fixture(scope="module")
def stack(tmp_path_factory, shared_cache):
    """A real server, `make deploy` (work pool, this host's device limits, deployments) and `make worker`."""
    from tests.deploy_support import running_stack

    base = tmp_path_factory.getbasetemp()  # its deployment runs write outputs in temporary directories
    roots = {"output_roots": [base], "cache_roots": [base, shared_cache], "config_roots": [base], "data_roots": [base]}
    with running_stack(tmp_path_factory.mktemp("fault-stack"), allow=roots) as s:
        yield s


def run_processes(rank: ProcessId) -> list[ProcessId]:
    """The rank, torchrun above it, and the flow-run process above that."""
    chain = [rank.pid]
    for _ in range(2):
        chain.append(parent_of(chain[-1]))
    return [ident for pid in chain if pid and (ident := ProcessId.of(pid))]


def stack_slot(stack) -> int:
    from tasks.concurrency import slot_names

    with stack.client() as client:
        return client.read_global_concurrency_limit_by_name(slot_names([])[0]).active_slots


def finished_state(stack, run_id: str, timeout: float = 900) -> str:
    return stack.wait_for([run_id], timeout=timeout)[run_id].state.type.value


def deployment_training(stack, cache: Path, tmp_path: Path, seed: int, save_steps: int):
    """An on-demand deployment run of 60 steps, returned once it trains: (overrides, flow run id, output, rank 0)."""
    args = overrides(cache, tmp_path / "runs", **{"train.max_steps": 60, "train.save_steps": save_steps,
                                                  "train.seed": seed, "hardware.gpus": "cpu"})
    run_id = stack.deployment_run("finetune/on-demand", overrides=args)
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

    again = stack.deployment_run("finetune/on-demand", overrides=args)
    assert finished_state(stack, again) == "COMPLETED", stack.logs_of(again)[-20:]
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["resumed_from_step"] == step and metrics["steps"] == 60


def test_a_server_restart_during_training_the_run_finishes_or_resumes(stack, cache, tmp_path):
    args, run_id, out, _ = deployment_training(stack, cache, tmp_path, seed=702, save_steps=10)
    stack.restart_server(down_seconds=10)
    state = finished_state(stack, run_id)
    if state != "COMPLETED":  # the run could not report to the server: the next one must pick up its checkpoints
        again = stack.deployment_run("finetune/on-demand", overrides=args)
        assert finished_state(stack, again) == "COMPLETED", stack.logs_of(again)[-20:]
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["steps"] == 60
    print(f"FAULT server restart: first run {state}; resumed_from_step={metrics['resumed_from_step']}")


# ---------------------------------------------------------------- GPU tier: a real CUDA out-of-memory


@pytest.mark.gpu
@pytest.mark.skipif(not read_inventory(), reason="needs an NVIDIA GPU (NVML finds none)")
def test_absurd_micro_batch_on_a_gpu_runs_out_of_memory_adapts_and_finishes(prefect_server, shared_cache, tmp_path):
    """~130k tokens in one packed micro-batch of a Qwen3-0.6B-shaped model, without checkpointing or Liger: its
    logits alone (150k vocabulary) need ~190 GB, so CUDA runs out of memory until the micro-batch is cut."""
    result = finetune(None, [
        "model.source=generated:qwen3-0.6b", "hardware.gpus=auto:1", "data.builtin_examples=4000",
        "data.max_length=128", "train.per_device_batch_size=1700", "train.micro_batch_tokens=131072",
        "train.gradient_checkpointing=false", "train.liger_kernel=false", "train.max_steps=2", "train.save_steps=1",
        "train.logging_steps=1", "train.retries=0", "eval.max_samples=4", "eval.batch_size=4",
        f"run.cache_dir={shared_cache / 'gpu-oom'}", f"run.output_dir={tmp_path / 'runs'}"])
    train = result.train
    assert train.steps == 2 and train.micro_batch_split >= 2 and train.oom_adaptations
    assert all("out of memory" in a["message"].lower() for a in train.oom_adaptations)
    print(f"FAULT GPU OOM: splits {[(a['split'], a['new_split']) for a in train.oom_adaptations]}, finished with "
          f"split {train.micro_batch_split}, peak reserved {train.peak_memory_mb} MiB, NVML process "
          f"{train.peak_process_memory_mb} MiB")
