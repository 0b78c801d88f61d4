"""Beyond one host on Ray, on this CPU machine: a 2-node Ray cluster (two raylets) trains the tiny model to the same
loss curve as 2-rank torchrun on one host; a killed Ray worker fails the attempt and Prefect's retry resumes from the
checkpoint Ray kept in the run's storage; `bench-scale --launchers` compares one host, two torchrun nodes and two
raylets in one report. (Split from test_scale_out.py so the two files run on different test workers.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune_flows.config.schema import load_config
from conftest import REPO, kill_rank_after_checkpoint, tiny_overrides
from flows.finetune import finetune
from scale_support import assert_same_curve

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_scale_out_launchers_smoke_run_compares_host_torchrun_nodes_and_raylets(shared_cache, tmp_path):
    """`bench-scale --launchers` on the CPU, one rank per "node": 2 gloo ranks on one host, two torchrun launchers at
    a c10d rendezvous on 127.0.0.1, and a Ray cluster of two raylets the benchmark starts (one address each), in one
    report; both two-node curves equal the host's (fp32, the same data order and seed)."""
    pytest.importorskip("ray.train", reason="the `ray` extra (make test installs it)")
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "benchmarks/scale_out.py", "--smoke", "--launchers",
                           "host,torchrun-2node,ray-2node", "--launch-timeout", "400",
                           "--state", str(tmp_path / "state"),
                           "--cache", str(shared_cache / "scale"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    runs = {r["launcher"]: r for r in report["runs"]}
    assert list(runs) == ["host", "torchrun-2node", "ray-2node"]
    for r in runs.values():
        assert (r["ranks"], r["backend"], r["rank_steps"], r["steps"]) == (2, "gloo", [3, 3], 3)
        assert r["whole_run_tokens_per_second"] > 0 and r["peak_reserved_gib"] > 0 and r["launch_seconds"] > 0
    assert [len(runs[n]["commands"]) for n in runs] == [1, 2, 1]  # two launchers for the torchrun nodes
    assert all("--nnodes=2" in c and "--rdzv-backend=c10d" in c for c in runs["torchrun-2node"]["commands"])
    # each node wrote its own result (no shared output directory)
    assert all((Path(log).parent / "train_metrics.json").is_file() for log in runs["torchrun-2node"]["logs"])
    # one worker per raylet, each its node's local rank 0 (a GPU run sets that rank's device by it)
    workers = runs["ray-2node"]["ray_workers"]
    assert {w.split(":")[0] for w in workers} == {"127.0.0.1", "127.0.0.2"} and len(workers) == 2
    assert all("local_rank=0," in w for w in workers)
    for name in ("torchrun-2node", "ray-2node"):
        assert report["vs_host"][name]["loss_steps_compared"] == 3
        assert_same_curve([tuple(x) for x in runs[name]["loss_curve"]], [tuple(x) for x in runs["host"]["loss_curve"]])
    assert "| ray-2node | 2 | 2 | gloo |" in (out / "report.md").read_text()


@pytest.fixture(scope="module")
def ray_cluster():
    """Two raylets on this machine (one CPU each, small object stores): two Ray nodes."""
    pytest.importorskip("ray.train", reason="the `ray` extra (make test installs it)")
    from ray.cluster_utils import Cluster

    # Everything on the loopback interface: Ray's single-machine mode (otherwise it advertises the host's address)
    loopback = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}
    saved = {k: os.environ.get(k) for k in loopback}
    os.environ.update(loopback)  # read by the raylets, their workers and the driver the training step starts
    node = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes(timeout=120)
        assert cluster.address.startswith("127.0.0.1:")
        yield cluster
    finally:
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def ray_overrides(cache: Path, runs: Path, cluster, **extra) -> list[str]:
    return tiny_overrides(cache, runs, **{"hardware.launcher": "ray", "hardware.ray_address": cluster.address,
                                          "hardware.nodes": 2, "hardware.gpus_per_node": 1, "hardware.gpus": "cpu",
                                          **extra})


def latest_artifact_keys() -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        return {a.key for a in arts if a.key}


@pytest.mark.timeout(1200)
def test_ray_train_on_two_nodes_matches_two_rank_torchrun(two_rank_reference, ray_cluster, shared_cache, tmp_path):
    result = finetune(load_config(None, ray_overrides(shared_cache / "scale", tmp_path, ray_cluster)))
    train, reference = result.train, two_rank_reference.train
    assert train.fingerprint != reference.fingerprint  # trained anew, not served from the torchrun run's cache
    assert train.world_size == 2 and train.backend == "gloo" and train.rank_steps == [6, 6]
    assert_same_curve(train.loss_curve, reference.loss_curve)
    out = Path(train.output_dir)
    assert sorted((out / "ray" / "train").glob("checkpoint_*/checkpoint/trainer_state.json"))  # Ray's storage
    log = (out / "train.log").read_text()
    assert "2 node(s)" in log and '"kind": "train_log"' in log  # the workers' progress reached the driver
    assert {"train-progress", "train-loss", "run-summary"} <= latest_artifact_keys()
    assert result.eval.adapter.generated == 8  # the adapter from Ray evaluates like any other


@pytest.mark.timeout(120)
def test_a_head_without_the_state_api_is_named_by_the_driver(ray_cluster):
    """A head started where only ray[train] is installed runs no State API: Ray Train's PlacementGroupCleaner logged
    a warning every second and stayed on the head after a stopped run, with no word on why. (A driver process of
    its own, as the training step starts: Ray reads the fixture's loopback settings when it is imported.)"""
    from finetune_flows.runtime.ray_cluster import state_api_problem

    code = ("import sys, ray; from finetune_flows.runtime.ray_cluster import state_api_problem as p; "
            "ray.init(address=sys.argv[1], log_to_driver=False); print(p(sys.argv[1])); ray.shutdown()")
    proc = subprocess.run([sys.executable, "-c", code, ray_cluster.address], cwd=REPO, capture_output=True, text=True,
                          timeout=100, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    problem = proc.stdout.strip().splitlines()[-1]
    assert problem.startswith(f"the Ray cluster at {ray_cluster.address} serves no State API"), proc.stdout
    assert "install 'ray[default]==2.60.0'" in problem
    assert state_api_problem("ray://head:10001") is None  # through Ray Client: not asked


@pytest.mark.timeout(600)
def test_more_workers_than_the_cluster_has_is_one_message_not_a_wait(ray_cluster, shared_cache, tmp_path):
    """Ray Train waited for good for workers a cluster cannot place, holding the run's device slot."""
    from finetune_flows.errors import UserInputError

    cfg = load_config(None, ray_overrides(shared_cache / "scale", tmp_path, ray_cluster, **{"hardware.nodes": 3}))
    start = time.monotonic()
    with pytest.raises(UserInputError, match=r"hardware.nodes x hardware.gpus_per_node = 3 training workers, one CPU "
                                             rf"each, but the Ray cluster at {ray_cluster.address} has 2 CPU\(s\)"):
        finetune(cfg)
    assert time.monotonic() - start < 300


@pytest.mark.timeout(1500)
def test_killed_ray_worker_fails_the_attempt_and_the_retry_resumes(prefect_server, ray_cluster, shared_cache,
                                                                   tmp_path):
    cache = shared_cache / "ray-resume"
    overrides = ray_overrides(cache, tmp_path, ray_cluster, **{
        "train.max_steps": 20, "train.save_steps": 5, "train.logging_steps": 5, "train.retries": 1,
        "train.save_total_limit": 20})
    # a Ray Train worker (rank 1, on the second raylet) dies once Ray has kept a checkpoint
    thread, killed = kill_rank_after_checkpoint(cache / "adapters", 1,
                                                "ray/train/checkpoint_*/checkpoint/trainer_state.json", timeout=900)
    result = finetune(load_config(None, overrides))
    thread.join(timeout=5)
    assert killed, "no Ray worker was killed"
    train = result.train
    assert train.resumed_from_step is not None and 5 <= train.resumed_from_step < 20
    assert train.steps == 20 and train.rank_steps == [20, 20] and train.loss_curve[-1][0] == 20
    log = (Path(train.output_dir) / "train.log").read_text()
    assert log.count("starting 2 CPU worker(s)") == 2  # the failed attempt and the retry
