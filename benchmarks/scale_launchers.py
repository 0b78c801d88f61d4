"""Scale-out across launchers: the same DDP training started three ways on the same devices, side by side.

    python benchmarks/scale_out.py --launchers host,torchrun-2node,ray-2node --shape qwen3-0.6b --gpus 2
    python benchmarks/scale_out.py --launchers host,torchrun-2node,ray-2node --smoke   # 1 CPU rank per "node"

- `host`: one torchrun on this host, one rank per GPU (`--standalone`); NCCL picks its transport (NVLink/P2P here).
- `torchrun-2node`: two torchrun launchers, each a "node" of one rank that sees one GPU, meeting at a c10d
  rendezvous on 127.0.0.1 (`hardware.nodes: 2`, `hardware.rdzv_endpoint`), each writing to its own output
  directory as nodes without a shared disk do (each node's local rank 0 writes, checkpoints on each node).
- `ray-2node`: a Ray cluster of two raylets started here (`ray.cluster_utils.Cluster`), each with one GPU (its own
  CUDA_VISIBLE_DEVICES: Ray hands a worker the raylet's GPU slot as an index into the raylet's own list) and its
  own loopback address (127.0.0.1, 127.0.0.2: Ray Train numbers local ranks per node address, so two raylets on
  one address would give the second worker local rank 1 on a "node" with one GPU); `hardware.launcher: ray`, the
  training step's Ray Train driver (finetune_flows/training/ray_worker.py).

Both two-node launches force NCCL onto its socket transport over loopback, as between hosts with plain Ethernet
(NCCL_SOCKETS below: NCCL's documented switches). Every launch runs the same command the training step runs
(finetune_flows/training/distributed.py `train_command`, through finetune_flows/runtime/launcher.py `run_worker`) on
one config, 4-bit base, training plan (computed once, for the host's GPUs), workload, seed and number of steps; only
the launch keys differ. NCCL_DEBUG=INFO lets the report say, from the ranks' own logs, which transport each launch's
channels used and which GPU (PCI bus id) each rank held. Rows: steady tokens/s (median, min..max over 5-step windows
after the worker's warm-up; none when a run is too short for one window), whole-run tokens/s, seconds from launch to
exit, the peak memory reserved on the busiest rank and nvidia-smi's peak, world size, backend, the loss curve and its
largest difference from the host run's at any logged step. A launch that fails or outlives --launch-timeout is killed
(all its processes) and reported as failed; the others still run. A process that fails after every node wrote its
results leaves the row, with the failure noted.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from benchmarks.scale_common import (
    config, fresh, head_lines, host_hardware, loss_difference, metrics_row, quantized_base, resolved, workload_dataset)
from benchmarks.train_speed import MemoryPoller, gpu_name
from finetune_flows.runtime.launcher import STABLE_HASHES, training_env

LAUNCHERS = ("host", "torchrun-2node", "ray-2node")
NODES = 2
NCCL_SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
                "NCCL_SOCKET_IFNAME": "lo"}
# Every launch: NCCL's init lines (transport per channel, bus id per rank); gloo on loopback; one OpenMP thread per
# rank, as torchrun sets for 2 ranks on one host and Ray for a 1-CPU worker (another count sums in another order);
# the training step's stable hashes.
COMMON_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
              **STABLE_HASHES}
RAY_NODE_IPS = ("127.0.0.1", "127.0.0.2")
# Ray's single-machine mode, for the driver and the raylets' workers: a loopback address is a node's own (otherwise
# Ray rewrites 127.0.0.1 to the host's address, and the driver looks for a raylet there that does not exist)
RAY_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def compile_caches(path: Path) -> dict[str, str]:
    """Empty compile caches of a launch's own (inductor's and Triton's, e.g. Liger's kernels), so no launch starts
    with the kernels an earlier one compiled and the whole-run figures compare."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(path), "TRITON_CACHE_DIR": str(path / "triton")}


def names(spec: str) -> list[str]:
    chosen = [n for n in spec.split(",") if n]
    unknown = sorted(set(chosen) - set(LAUNCHERS))
    if unknown:
        raise SystemExit(f"--launchers: unknown {', '.join(unknown)} (choose from {', '.join(LAUNCHERS)})")
    return chosen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One launcher process (torchrun, or the Ray Train driver) as the training step starts it."""

    def __init__(self, argv: list[str], env: dict[str, str], out: Path):
        self.argv, self.env, self.out = argv, env, out
        self.error: BaseException | None = None
        self.failed_at = float("inf")
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from finetune_flows.runtime.launcher import run_worker

        try:
            run_worker("train", self.argv, self.env, self.out)
        except BaseException as exc:
            self.error, self.failed_at = exc, time.monotonic()

    def kill(self) -> None:
        """SIGKILL to the launcher's session and every process below it (ranks, compile workers)."""
        from finetune_flows.runtime.processes import read_record, signal_tree, tree

        ident = read_record(self.out / "train.pid")
        if ident is not None:
            signal_tree(tree(ident.pid), ident.pid, signal.SIGKILL)


def run_nodes(nodes: list[Node], timeout: float, grace: float = 60) -> None:
    """Start every node's launcher and wait for all. The others get `grace` seconds after one fails (a rank that
    dies on its way out must not cut off a peer still writing its results), then they are killed, as they are when
    the time is up: they would wait for their peer until the rendezvous or NCCL timeout."""
    for node in nodes:
        node.thread.start()
    deadline = time.monotonic() + timeout
    try:
        while any(n.thread.is_alive() for n in nodes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"still running after --launch-timeout {timeout:g} s")
            if time.monotonic() > min(n.failed_at for n in nodes) + grace:
                break
            time.sleep(0.5)
    finally:
        for node in nodes:
            if node.thread.is_alive():
                node.kill()
        for node in nodes:
            node.thread.join(60)
    first = min(nodes, key=lambda n: n.failed_at)  # the cause, not a peer killed after it
    if first.error is not None:
        raise first.error


@contextmanager
def ray_cluster(gpu_ids: list[int], out: Path) -> Iterator[str]:
    """Two raylets on this machine, one GPU (or one CPU) each, each on its own loopback address; yields the address
    the driver joins. Every Ray process stops on the way out."""
    import os

    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # offline: no usage report

    def node(i: int) -> dict:
        # the raylet's environment is its workers' (ray/_private/worker.py reads CUDA_VISIBLE_DEVICES at start)
        devices = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpu_ids[i]) if gpu_ids else ""}
        return {"num_cpus": 1, "num_gpus": 1 if gpu_ids else 0, "object_store_memory": 100 * 2**20,
                "node_ip_address": RAY_NODE_IPS[i],
                "env_vars": {**COMMON_ENV, **NCCL_SOCKETS, **RAY_LOOPBACK, **devices,
                             **compile_caches(out / f"compile-cache-node{i}")}}

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={**node(0), "include_dashboard": False})
    try:
        for i in range(1, NODES):
            cluster.add_node(**node(i))
        cluster.wait_for_nodes(timeout=120)
        yield cluster.address
    finally:
        cluster.shutdown()


def nccl_seen(logs: str) -> dict:
    """What NCCL's init lines say: the transports its channels used and the GPUs (PCI bus ids) of the ranks."""
    return {"nccl_transports": sorted(set(re.findall(r"NCCL INFO Channel .* via (\S+)", logs))),
            "gpu_bus_ids": sorted(set(re.findall(r"NCCL INFO .* busId (\w+)", logs)))}


def ray_placement(logs: str) -> list[str]:
    """Ray Train's worker group as its controller logged it: each worker's node address and ranks."""
    found = re.findall(r"\(ip=(\S+), pid=\d+\) (world_rank=\d+, local_rank=\d+, node_rank=\d+)", logs)
    return sorted({f"{ip}: {ranks}" for ip, ranks in found})


def shown(argv: list[str]) -> str:
    return " ".join(["python", *argv[1:]] if argv[0] == sys.executable else argv)


class LaunchBench:
    """The shared set-up (one config, base and training plan) and the three launches."""

    def __init__(self, args, env, state: Path, cache: Path, data: Path, stats: dict):
        from finetune_flows.training.train import training_plan

        self.args, self.env, self.state, self.cache, self.data = args, env, state, cache, data
        self.ids = [g.index for g in env.gpus][:args.gpus]
        cfg = self.config(host_hardware(args, self.ids))
        sel, plan = resolved(cfg, env, self.ids)
        self.base = quantized_base(cfg, plan, sel, state / "work" / "launchers")
        self.dataset = workload_dataset(data, stats)
        self.tplan = training_plan(cfg, self.dataset, self.base, plan, sel)
        self.run_id = f"bench-{time.strftime('%Y%m%d-%H%M%S')}"

    def config(self, hardware: list[str]):
        return config(self.args, self.cache, "ddp", hardware)

    def node(self, out: Path, hardware: list[str], ids: list[int], extra_env: dict[str, str]) -> Node:
        """The training step's launch command for this config on these GPUs, with its job in `out`."""
        from finetune_flows.training.distributed import train_command
        from finetune_flows.training.train import write_train_job

        cfg = self.config(hardware)
        sel, plan = resolved(cfg, self.env, ids)
        plan = plan.with_training(self.tplan)
        job = write_train_job(fresh(out), cfg, plan, self.base, self.dataset, ids, self.run_id)
        env = training_env({**sel.env, **COMMON_ENV, **compile_caches(out / "compile-cache"), **extra_env})
        return Node(train_command(cfg, plan, job, self.run_id), env, out)

    def host(self, out: Path) -> list[Node]:
        return [self.node(out, host_hardware(self.args, self.ids), self.ids, {})]

    def torchrun_nodes(self, out: Path) -> list[Node]:
        launch = ["hardware.nodes=2", f"hardware.rdzv_endpoint=127.0.0.1:{free_port()}"]
        nodes = []
        for i in range(NODES):  # node i: GPU i, or one CPU rank
            ids = self.ids[i:i + 1]
            hardware = host_hardware(self.args, ids) if ids else ["hardware.gpus=cpu", "hardware.cpu_processes=1"]
            nodes.append(self.node(out / f"node{i}", [*launch, *hardware], ids, NCCL_SOCKETS))
        return nodes

    def ray_nodes(self, out: Path, address: str) -> list[Node]:
        launch = ["hardware.launcher=ray", f"hardware.ray_address={address}", "hardware.nodes=2",
                  "hardware.gpus_per_node=1"]
        return [self.node(out, [*launch, *host_hardware(self.args, self.ids)], self.ids, RAY_LOOPBACK)]

    def run(self, name: str) -> dict:
        out = self.state / "out" / name
        started = time.monotonic()
        nodes: list[Node] = []
        exit_error = None
        try:
            with MemoryPoller(self.ids) as mem:
                if name == "ray-2node":
                    with ray_cluster(self.ids, out) as address:
                        nodes = self.ray_nodes(out, address)
                        run_nodes(nodes, self.args.launch_timeout)
                else:
                    nodes = self.host(out) if name == "host" else self.torchrun_nodes(out)
                    run_nodes(nodes, self.args.launch_timeout)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"[-3000:]
            # every node wrote its results (fresh directories) before a process failed, e.g. a rank on its way out
            if not (nodes and all((n.out / "train_metrics.json").is_file() for n in nodes)):
                print(f"[{name}] failed: {exc}", flush=True)
                return {"launcher": name, "error": message, "logs": [str(o) for o in sorted(out.glob("**/train.log"))]}
            exit_error = message
            print(f"[{name}] a process failed after every node wrote its results: {exc}", flush=True)
        seconds = round(time.monotonic() - started, 1)
        r = json.loads((nodes[0].out / "train_metrics.json").read_text())
        logs = "\n".join((n.out / "train.log").read_text(errors="replace") for n in nodes)
        row = {"launcher": name, "model": f"generated:{self.args.shape}", "device": gpu_name(self.ids),
               "nodes": 1 if name == "host" else NODES, **metrics_row(r, mem.peak), "launch_seconds": seconds,
               **nccl_seen(logs), "rank_steps": r["rank_steps"],
               "ray_workers": ray_placement(logs),
               "forced_env": {} if name == "host" else NCCL_SOCKETS,
               "commands": [shown(n.argv) for n in nodes], "logs": [str(n.out / "train.log") for n in nodes],
               "exit_error": exit_error}
        print(f"[{name}] world size {row['ranks']} ({row['backend']}), {row['tokens_per_second']} tokens/s steady "
              f"({row['whole_run_tokens_per_second']} whole run), peak reserved {row['peak_reserved_gib']} GiB, "
              f"NCCL {row['nccl_transports'] or '-'}, final loss {row['final_loss']:.6f}", flush=True)
        return row


def finish(rows: dict[str, dict]) -> dict:
    """The runs in launcher order, and each two-node launch against the host run."""
    ordered = {n: rows[n] for n in LAUNCHERS if n in rows}
    host = ordered.get("host")
    versus = {}
    for name, r in ordered.items():
        if name == "host" or not host or "error" in host or "error" in r:
            continue
        diff, compared = loss_difference(r["loss_curve"], host["loss_curve"])
        versus[name] = {
            "steady_tokens_per_second_over_host": _ratio(r["tokens_per_second"], host["tokens_per_second"]),
            "whole_run_tokens_per_second_over_host": _ratio(r["whole_run_tokens_per_second"],
                                                            host["whole_run_tokens_per_second"]),
            "max_loss_difference": diff, "loss_steps_compared": compared}
    return {"runs": list(ordered.values()), "vs_host": versus, "nccl_sockets_env": NCCL_SOCKETS}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def markdown(rep: dict) -> str:
    lines = head_lines(rep, "Scale-out across launchers") + [
        "| launch | nodes | world size | backend | NCCL transport (ranks' logs) | tokens/s (steady) | min..max | "
        "whole run | launch to exit s | peak reserved GiB (busiest rank) | nvidia-smi GiB | final loss | "
        "max loss diff vs host |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["runs"]:
        if "error" in r:
            lines.append(f"| {r['launcher']} | failed: {r['error'].splitlines()[0][:200]} |" + " |" * 11)
            continue
        versus = rep["vs_host"].get(r["launcher"], {})
        steady = r["tokens_per_second"] or "none (too few steps for a window)"
        lines.append(f"| {r['launcher']} | {r['nodes']} | {r['ranks']} | {r['backend']} | "
                     f"{', '.join(r['nccl_transports']) or '-'} | {steady} | "
                     f"{r['tokens_per_second_min']}..{r['tokens_per_second_max']} | "
                     f"{r['whole_run_tokens_per_second']} | {r['launch_seconds']} | {r['peak_reserved_gib']} | "
                     f"{r['nvidia_smi_peak_gib']} | {r['final_loss']:.6f} | {versus.get('max_loss_difference', '')} |")
    late = [r for r in rep["runs"] if r.get("exit_error")]
    if late:
        lines += ["", "A process failed after every node had written its results (the figures above were measured "
                  "before):", ""] + [f"- {r['launcher']}: {r['exit_error'].splitlines()[0][:300]}" for r in late]
    if rep["vs_host"]:
        lines += ["", "## Against the host run", ""]
        lines += [f"- {name}: " + ", ".join(f"{k} {v}" for k, v in v.items()) for name, v in rep["vs_host"].items()]
    done = [r for r in rep["runs"] if "error" not in r]
    if done:
        lines += ["", "## Loss curves", "", "| step | " + " | ".join(r["launcher"] for r in done) + " |",
                  "|---|" + "---|" * len(done)]
        curves = [dict(map(tuple, r["loss_curve"])) for r in done]
        for step in sorted(set().union(*curves)):
            lines.append(f"| {step} | " + " | ".join(f"{c[step]:.6f}" if step in c else "" for c in curves) + " |")
        lines += ["", "## Launch commands", ""]
        for r in done:
            forced = " ".join(f"{k}={v}" for k, v in r["forced_env"].items())
            lines += [f"- {r['launcher']} ({', '.join(r['gpu_bus_ids']) or 'no GPU'}):"]
            lines += [f"  `{(forced + ' ') if forced else ''}{c}`" for c in r["commands"]]
            lines += [f"  Ray worker at {w}" for w in r.get("ray_workers", [])]
    return "\n".join(lines) + "\n"
