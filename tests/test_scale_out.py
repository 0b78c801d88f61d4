"""Beyond one host, on this CPU machine: a 2-node torchrun rendezvous on localhost trains the tiny model to the same
loss curve as 2-rank torchrun on one host; FSDP2-QLoRA on the same 2 ranks (gloo) trains to the same curve, resumes
after a killed rank and saves the same adapter; the launch commands and settings. (Ray: tests/test_scale_ray.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, child_env, tiny_config, tiny_overrides
from flows.finetune import finetune
from finetune_flows.config.schema import load_config
from finetune_flows.training.distributed import (agreed_checkpoint, fingerprint_parts, newest_checkpoint,
                                                 torchrun_command, train_command)
from finetune_flows.config.plan import Plan
from finetune_flows.errors import ConfigError
from scale_support import assert_same_curve, free_port

pytestmark = pytest.mark.slow

CPU_PLAN = Plan(device="cpu", nproc=1, precision="fp32", compute_dtype="float32", train_attn="sdpa",
                eval_attn="sdpa")


# ------------------------------------------------------------------ launch commands and config (no processes)


def test_single_host_launch_and_cache_keys_are_unchanged(tmp_path):
    cfg = load_config(None, [])
    assert fingerprint_parts(cfg, CPU_PLAN) == []
    cmd = torchrun_command("finetune_flows.training.worker", tmp_path / "job.json", cfg, CPU_PLAN, "abc")
    assert cmd[1:] == ["-m", "torch.distributed.run", f"--log-dir={tmp_path / 'torchrun'}", "--standalone",
                       "--nproc_per_node=1", "-m", "finetune_flows.training.worker", str(tmp_path / "job.json")]


def test_one_cpu_rank_runs_without_torchrun_and_gets_what_torchrun_would_give_it(tmp_path, monkeypatch):
    """One CPU rank is the rank body itself (so the launcher can fork it from its fork server); more ranks, GPUs and
    nodes keep torchrun. The rank then sets up a world of one with a free port for the process group's store."""
    cfg, job = load_config(None, []), tmp_path / "job.json"
    assert train_command(cfg, CPU_PLAN, job, "abc")[1:] == ["-m", "finetune_flows.training.worker", str(job)]
    gpu = CPU_PLAN.model_copy(update={"device": "cuda"})
    for plan in (CPU_PLAN.model_copy(update={"nproc": 2}), gpu):
        assert "torch.distributed.run" in train_command(cfg, plan, job, "abc")
    from finetune_flows.training.distributed import single_rank_defaults

    rank_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in rank_vars})  # a copy: no leak
    single_rank_defaults()
    assert [os.environ[v] for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")] == ["0", "0", "1", "127.0.0.1"]
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536
    monkeypatch.setenv("RANK", "1")  # started by torchrun: its variables stand
    monkeypatch.setenv("MASTER_PORT", "29500")
    single_rank_defaults()
    assert os.environ["RANK"] == "1" and os.environ["MASTER_PORT"] == "29500"


def test_multi_node_torchrun_uses_c10d_rendezvous_named_by_the_run(tmp_path):
    cfg = load_config(None, ["hardware.nodes=2", "hardware.rdzv_endpoint=node0.cluster:29400"])
    plan = CPU_PLAN.model_copy(update={"nproc": 4})
    cmd = train_command(cfg, plan, tmp_path / "job.json", "run-fingerprint")
    assert cmd[cmd.index("torch.distributed.run") + 1:cmd.index("-m", 3)] == [
        f"--log-dir={tmp_path / 'torchrun'}", "--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0.cluster:29400",
        "--rdzv-id=run-fingerprint", "--max-restarts=0", "--rdzv-conf=join_timeout=600"]
    assert fingerprint_parts(cfg, plan) == ["torchrun", 2, 4]
    ray = load_config(None, ["hardware.launcher=ray", "hardware.nodes=3", "hardware.gpus_per_node=8"])
    assert train_command(ray, plan, tmp_path / "job.json", "x")[1:] == ["-m", "finetune_flows.training.ray_worker",
                                                                         str(tmp_path / "job.json")]
    assert fingerprint_parts(ray, plan) == ["ray", 3, 8]


def test_launch_settings_that_cannot_work_are_refused_together():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["hardware.nodes=2", "hardware.ray_address=10.0.0.1:6379"])
    assert "hardware.rdzv_endpoint" in str(err.value) and "hardware.ray_address is for" in str(err.value)
    with pytest.raises(ConfigError, match="rdzv_endpoint is for torchrun"):
        load_config(None, ["hardware.launcher=ray", "hardware.rdzv_endpoint=a:1"])
    with pytest.raises(ConfigError, match="hardware.rdzv_endpoint"):
        load_config(None, ["hardware.nodes=2", "hardware.rdzv_endpoint=no-port"])


def test_gpus_per_node_must_match_what_torchrun_starts_here():
    from finetune_flows.training.distributed import plan_problems

    assert plan_problems(load_config(None, ["hardware.gpus_per_node=1"]), CPU_PLAN) == []
    problems = plan_problems(load_config(None, ["hardware.gpus_per_node=2"]), CPU_PLAN)
    assert problems and "hardware.cpu_processes=1" in problems[0]
    gpu_plan = CPU_PLAN.model_copy(update={"device": "cuda", "nproc": 4})
    assert "selects 4 GPU(s)" in plan_problems(load_config(None, ["hardware.gpus_per_node=8"]), gpu_plan)[0]
    assert plan_problems(load_config(None, ["hardware.launcher=ray", "hardware.gpus_per_node=8"]), gpu_plan) == []


def test_more_cpu_ranks_than_cores_is_a_warning_naming_both_and_the_key():
    """4 CPU ranks on 2 cores ran without a word, each loading the whole model. The training step logs this before
    torchrun starts the ranks; as many ranks as cores, GPU ranks and Ray workers are not warned about."""
    from finetune_flows.training.distributed import oversubscribed_cores, usable_cores

    cfg, plan = load_config(None, ["hardware.cpu_processes=4"]), CPU_PLAN.model_copy(update={"nproc": 4})
    assert oversubscribed_cores(cfg, plan, cores=2) == (
        "hardware.cpu_processes=4 starts 4 training ranks on 2 CPU core(s) here: each rank loads the whole model and "
        "computes on its own thread, so they take turns on the cores and every optimizer step waits for the slowest; "
        "set hardware.cpu_processes to at most 2")
    assert oversubscribed_cores(cfg, plan, cores=4) is None
    assert oversubscribed_cores(cfg, plan.model_copy(update={"device": "cuda"}), cores=2) is None
    assert oversubscribed_cores(load_config(None, ["hardware.launcher=ray"]), plan, cores=2) is None
    # this host's own count: its affinity mask (the test machine's cores), so one rank more is always too many
    cores = usable_cores()
    assert 1 <= cores <= (os.cpu_count() or cores)
    crowded = load_config(None, [f"hardware.cpu_processes={cores + 1}"])
    assert f"on {cores} CPU core(s)" in oversubscribed_cores(crowded, CPU_PLAN.model_copy(update={"nproc": cores + 1}))


def test_resume_point_without_a_process_group_is_the_newest_complete_checkpoint(tmp_path):
    from finetune_flows.training.checkpoints import write_checkpoint_manifest

    for step in (5, 10, 15):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        if step < 15:  # 15: killed while saving, before its manifest
            write_checkpoint_manifest(tmp_path / f"checkpoint-{step}")
    assert agreed_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert agreed_checkpoint(tmp_path / "missing") is None


def test_under_ray_the_resume_point_is_the_newer_of_rays_and_the_runs_own(tmp_path):
    """Ray Train's newest checkpoint lags the reports: stopped just after step 40 was saved, Ray knew step 20 and the
    retry resumed from it (train_metrics.json: resumed_from_step 20), though checkpoint-40 was complete."""
    def checkpoint(path: Path, step: int) -> Path:
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        return path

    ray20 = checkpoint(tmp_path / "ray/train/checkpoint_a/checkpoint", 20)
    own40 = checkpoint(tmp_path / "checkpoints/checkpoint-40", 40)
    assert newest_checkpoint(ray20, own40) == own40
    ray40 = checkpoint(tmp_path / "ray/train/checkpoint_b/checkpoint", 40)
    assert newest_checkpoint(ray40, own40) == ray40  # a tie: Ray's (its storage is the one every node reaches)
    assert newest_checkpoint(ray20, None) == ray20 and newest_checkpoint(None, own40) == own40
    assert newest_checkpoint(None, None) is None


def test_launcher_report_reads_nccl_and_ray_logs_and_keeps_a_failed_launch():
    from benchmarks.scale_launchers import finish, markdown, nccl_seen, ray_placement

    # the lines as NCCL 2.2x and Ray Train 2.60 print them (NCCL's INFO(NCCL_INIT|NCCL_NET, ...) formats)
    log = "\n".join([
        "h:81:90 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0",
        "(RayTrainWorker pid=7) h:82:91 [0] NCCL INFO Channel 01/0 : 1[0] -> 0[0] [receive] via NET/Socket/0",
        "h:81:81 [0] NCCL INFO ncclCommInitRankConfig comm 0x5 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 18000 "
        "commId 0x1 - Init COMPLETE",
        "h:82:82 [0] NCCL INFO ncclCommInitRankConfig comm 0x6 rank 1 nranks 2 cudaDev 0 nvmlDev 1 busId 2a000 "
        "commId 0x1 - Init COMPLETE",
        "(TrainController pid=3) - (ip=127.0.0.2, pid=9) world_rank=1, local_rank=0, node_rank=1"])
    assert nccl_seen(log) == {"nccl_transports": ["NET/Socket/0"], "gpu_bus_ids": ["18000", "2a000"]}
    assert ray_placement(log) == ["127.0.0.2: world_rank=1, local_rank=0, node_rank=1"]

    def row(name: str, speed: float, losses: list[float]) -> dict:
        return {"launcher": name, "nodes": 2, "ranks": 2, "backend": "nccl", "nccl_transports": [], "gpu_bus_ids": [],
                "tokens_per_second": speed, "tokens_per_second_min": speed, "tokens_per_second_max": speed,
                "whole_run_tokens_per_second": speed / 2, "launch_seconds": 1.0, "peak_reserved_gib": 1.0,
                "nvidia_smi_peak_gib": None, "final_loss": losses[-1], "forced_env": {}, "commands": ["x"],
                "loss_curve": [[step, loss] for step, loss in enumerate(losses, 1)]}

    done = finish({"ray-2node": {"launcher": "ray-2node", "error": "TimeoutError: still running\nmore"},
                   "torchrun-2node": {**row("torchrun-2node", 900.0, [2.0, 1.6]), "exit_error": "WorkerFailed: rank 1"},
                   "host": row("host", 1000.0, [2.0, 1.5])})
    assert [r["launcher"] for r in done["runs"]] == ["host", "torchrun-2node", "ray-2node"]
    assert done["vs_host"] == {"torchrun-2node": {
        "steady_tokens_per_second_over_host": 0.9, "whole_run_tokens_per_second_over_host": 0.9,
        "max_loss_difference": 0.1, "loss_steps_compared": 2}}
    text = markdown({"date": "d", "command": "c", "host": "h", "driver": None, "cuda": None, "python": "3",
                     "versions": {}, "gpus": [], "ranks": 2, "steps": 2, "workload": {
                         "rows": 1, "median_length": 1, "tokens": 1}, **done})
    assert "| ray-2node | failed: TimeoutError: still running |" in text and "| 2 | 1.500000 | 1.600000 |" in text
    assert "written its results" in text and "- torchrun-2node: WorkerFailed: rank 1" in text  # measured, then failed


# ------------------------------------------------------------------ real runs


@pytest.mark.timeout(1200)
def test_fsdp_on_two_ranks_matches_ddp_resumes_after_a_killed_rank_and_saves_the_same_adapter(
        two_rank_reference, shared_cache, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from finetune_flows.runtime.lifecycle import FAULTS_ENV

    marker = tmp_path / "killed"
    # rank 1 also writes its part of each checkpoint late: checkpoint-3 must still be complete when rank 1 dies
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"sigkill_at_step": 5, "sigkill_rank": 1, "once": str(marker),
                                               "rng_save_seconds": 1}))
    result = finetune(tiny_config(shared_cache / "scale", tmp_path, **{
        "hardware.cpu_processes": 2, "hardware.strategy": "fsdp", "train.retries": 1, "export.merge": False}))
    train, reference = result.train, two_rank_reference.train
    assert marker.exists(), "rank 1 was never killed"
    assert train.strategy == "fsdp" and reference.strategy == "ddp" and train.backend == "gloo"
    assert train.resumed_from_step == 3 and train.rank_steps == [6, 6]
    assert [a["outcome"] for a in train.attempts] == ["crashed", "completed"]
    # the same steps and losses as DDP: 2-rank reduce-scatter and all-reduce both average two fp32 gradients
    assert_same_curve(train.loss_curve, reference.loss_curve)
    # sharded for real: each rank holds about half of the parameters (DDP: all of them), and the checkpoints are
    # the Trainer's FSDP ones (adapter state and optimizer gathered on rank 0) beside the PEFT adapter
    assert all(f < 0.6 * d for f, d in zip(train.rank_param_mb, reference.rank_param_mb)), (train.rank_param_mb,
                                                                                          reference.rank_param_mb)
    checkpoint = Path(train.output_dir) / "checkpoints" / "checkpoint-6"
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "adapter_model.safetensors"} <= {
        p.name for p in checkpoint.iterdir()}
    mine, theirs = (load_file(Path(t.adapter_path) / "adapter_model.safetensors") for t in (train, reference))
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    assert all(mine[k].dtype == theirs[k].dtype and (mine[k] - theirs[k]).abs().max() <= 1e-5 for k in mine)
    assert result.eval.adapter.generated == 8  # evaluated like the DDP adapter, to the same loss
    assert abs(result.eval.adapter.loss - two_rank_reference.eval.adapter.loss) <= 1e-4


@pytest.mark.timeout(900)
def test_scale_out_benchmark_smoke_run_writes_the_report(shared_cache, tmp_path):
    """`make bench-scale` on 2 CPU ranks, its FSDP half (the DDP half is the same code with another plan; the
    comparison is tested in tests/test_sharding.py), reusing the 4-bit base the run above stored."""
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "benchmarks/scale_out.py", "--smoke", "--strategies", "fsdp", "--steps", "2",
                           "--state", str(tmp_path / "state"), "--cache", str(shared_cache / "scale"), "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["versions"]["torch"] and report["ranks"] == 2 and report["steps"] == 2
    [run] = report["runs"]
    assert (run["strategy"], run["quant_storage"], run["ranks"], run["steps"]) == ("fsdp", "float32", 2, 2)
    assert run["whole_run_tokens_per_second"] > 0 and run["peak_reserved_gib"] > 0
    assert len(run["param_mib_per_rank"]) == 2 and len(run["loss_curve"]) == 2
    assert "| fsdp | 2 | float32 |" in (out / "report.md").read_text()


@pytest.mark.timeout(600)
def test_more_ranks_than_packs_is_refused_before_any_rank_starts(prefect_server, shared_cache, tmp_path):
    """108 rows of ~76 tokens fill one pack of 120 rows' tokens: 2 ranks cannot take one optimizer step. Refused
    from the training plan, naming the ranks, before torchrun starts ranks that would each load the model first."""
    from finetune_flows.errors import UserInputError

    cache = shared_cache / "scale"
    earlier = set((cache / "adapters").glob("*"))
    with pytest.raises(UserInputError, match=r"make 1 packs .* fewer than one optimizer step needs \(1 per rank x 2 "
                                             r"ranks\)\. Train on fewer ranks \(hardware\.cpu_processes"):
        finetune(tiny_config(cache, tmp_path, **{"hardware.cpu_processes": 2, "train.per_device_batch_size": 120,
                                                 "train.retries": 0}))
    # Other test files may train into this shared cache at the same time: a worker of this run would have written
    # a job with its 120 rows per device first
    jobs = [e / "train.job.json" for e in set((cache / "adapters").glob("*")) - earlier]
    started = [j for j in jobs if j.is_file()
               and json.loads(j.read_text())["config"]["train"]["per_device_batch_size"] == 120]
    assert not started, started


@pytest.mark.timeout(300)
@pytest.mark.parametrize("endpoint", ["no other node", "port held, never answers"])
def test_a_rendezvous_that_never_completes_is_logged_bounded_and_named(endpoint, tmp_path, caplog):
    """hardware.nodes=2 where the other node never joins, or where the endpoint's port is held by a program that
    never answers: real torchrun printed nothing, for 600 s (its join_timeout) or without end (its connection to the
    store is not bounded by it). The wait is logged with its bound, and the attempt ends with one message naming the
    endpoint: torchrun's join_timeout, or the launcher's stop RENDEZVOUS_MARGIN s after it."""
    import socket
    import time

    from finetune_flows.errors import RendezvousFailed
    import psutil

    from finetune_flows.training.distributed import RENDEZVOUS_MARGIN, run_ranks

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    if endpoint == "port held, never answers":
        holder.listen(8)  # the kernel completes connections; nothing reads or writes on them
    port = holder.getsockname()[1]
    if endpoint == "no other node":
        holder.close()
    cfg = load_config(None, ["hardware.nodes=2", f"hardware.rdzv_endpoint=127.0.0.1:{port}",
                             "hardware.rdzv_timeout_seconds=10"])
    job = tmp_path / "work" / "train.job.json"
    started = time.monotonic()
    try:
        with caplog.at_level("INFO", logger="finetune_flows"), pytest.raises(RendezvousFailed) as failed:
            run_ranks(cfg, CPU_PLAN, job, "a-run-that-meets-nobody", {"OMP_NUM_THREADS": "1"}, tmp_path / "work",
                      stop_grace=5)
    finally:
        holder.close()
    waited = time.monotonic() - started
    assert (f"waiting for all 2 nodes at the c10d rendezvous at 127.0.0.1:{port} (id a-run-that-m), at most 10 s "
            "(hardware.rdzv_timeout_seconds)") in caplog.text
    assert str(failed.value).startswith(f"hardware.nodes=2: the nodes did not all meet at the c10d rendezvous at "
                                        f"127.0.0.1:{port} (id a-run-that-m) within 10 s")
    assert 10 <= waited < 10 + RENDEZVOUS_MARGIN + 30, waited
    if endpoint == "no other node":  # torchrun's own timeout, well before the launcher's
        assert "RendezvousTimeoutError" in failed.value.tail and waited < 10 + RENDEZVOUS_MARGIN
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if "--rdzv-id=a-run-that-meets-nobody" in
            (p.info["cmdline"] or [])]
    assert not left, left  # the launcher stopped torchrun and waited for it


@pytest.mark.timeout(300)
def test_a_rank_that_raises_is_named_not_the_peers_torchrun_stopped(tmp_path):
    """Rank 1 raises while rank 0 still works: torchrun SIGTERMs rank 0 and lists it under "Failures:" above the
    root cause, and its summary pushes rank 1's traceback out of the tail. The attempt's error (what a repeated
    failure reports) was "killed by SIGTERM"; it is rank 1's exception."""
    from finetune_flows.errors import WorkerFailed
    from finetune_flows.runtime.launcher import run_worker
    from finetune_flows.training.attempts import worker_error

    script = tmp_path / "rank.py"
    script.write_text("import time\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 1:\n    raise ValueError('rank 1 cannot train on this')\n"
                      "time.sleep(120)\n")
    with pytest.raises(WorkerFailed) as failed:
        run_worker("train", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script)], {}, tmp_path / "work", stop_grace=5)
    assert "Signal 15 (SIGTERM) received" in failed.value.tail  # rank 0, stopped by torchrun
    assert worker_error(failed.value) == "[rank1]: ValueError: rank 1 cannot train on this"
    assert str(failed.value).count("ValueError: rank 1 cannot train on this") == 1  # in the message, once


def test_two_process_torchrun_on_cpu(two_rank_reference):
    """The single-host reference itself: 2 gloo ranks under torchrun, each taking every step (DDP)."""
    train = two_rank_reference.train
    assert train.world_size == 2 and train.steps == 6
    assert train.backend == "gloo" and train.rank_steps == [6, 6]
    assert "trained 6 steps on 2 cpu rank(s)" in (Path(train.output_dir) / "train.log").read_text()


@pytest.mark.timeout(1200)
def test_two_torchrun_nodes_on_localhost_match_two_ranks_on_one_host(two_rank_reference, shared_cache, tmp_path):
    """Two launchers (two flow processes, one rank each) meet at a c10d rendezvous on 127.0.0.1. Each "node" has
    its own cache directory, as nodes with their own disks do: both save checkpoints and the adapter."""
    from prefect.settings import PREFECT_API_URL

    node_caches = [tmp_path / "node0-cache", tmp_path / "node1-cache"]
    for cache in node_caches:  # the same inputs on each node's disk
        shutil.copytree(shared_cache / "scale", cache, ignore=shutil.ignore_patterns("adapters", "evaluations"))
    defaults = tmp_path / "defaults.yaml"  # the CLI's default is configs/demo.yaml; the reference ran on defaults
    defaults.write_text("{}\n")
    endpoint = f"127.0.0.1:{free_port()}"
    # one thread per rank, as torchrun sets for the 2-rank reference (another thread count sums in another order);
    # gloo on the loopback interface
    env = child_env(PREFECT_API_URL=PREFECT_API_URL.value(), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen(
        [sys.executable, "flows/finetune.py", f"--config={defaults}", *[f"--set={o}" for o in tiny_overrides(
            cache, tmp_path / f"runs{i}", **{"hardware.nodes": 2, "hardware.rdzv_endpoint": endpoint})]],
        cwd=REPO, env={**env, "FINETUNE_FLOWS_CACHE": str(cache)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True) for i, cache in enumerate(node_caches)]
    try:
        outputs = [p.communicate(timeout=1100)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-4000:]
    summaries = [json.loads(next((tmp_path / f"runs{i}").glob("*/summary.json")).read_text()) for i in range(2)]
    trains = [s["train"] for s in summaries]
    assert trains[0]["fingerprint"] == trains[1]["fingerprint"]  # the rendezvous id both launchers used
    for train, cache in zip(trains, node_caches):
        assert train["world_size"] == 2 and train["rank_steps"] == [6, 6] and train["backend"] == "gloo"
        assert Path(train["output_dir"]).is_relative_to(cache)  # each node wrote its own result (no shared disk)
        assert sorted(Path(train["output_dir"]).glob("checkpoints/checkpoint-*/trainer_state.json"))
        assert_same_curve([tuple(x) for x in train["loss_curve"]], two_rank_reference.train.loss_curve)
    adapters = [Path(t["adapter_path"]) / "adapter_model.safetensors" for t in trains]
    assert adapters[0].read_bytes() == adapters[1].read_bytes()  # DDP: the same weights on both nodes
