"""Training beyond one host: the launch command (torchrun on one or many nodes, or Ray Train), and the rank
bookkeeping that works whether or not the nodes share a file system.

Multi-node torchrun: every node runs the same flow; each launcher runs
`torchrun --nnodes=N --nproc-per-node=P --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=<run id>`, and the
c10d rendezvous (hosted by whichever launcher first binds HOST:PORT on the endpoint's machine) assigns node ranks.
The run id is the training fingerprint: nodes that run the same config on the same data and base compute the same
id without talking to each other, and a different run never joins them.

Inside the ranks, facts about other ranks travel through the process group (`all_gather_object`), not through
files in a shared directory: whether the output directory is shared (then global rank 0 writes; otherwise each
node's local rank 0 writes and the Trainer saves checkpoints on each node), which checkpoint every node can resume
from, and each rank's record for the run summary.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any

from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.config.plan import Plan
from finetune_flows.errors import RendezvousFailed, WorkerFailed, WorkerStartTimeout
from finetune_flows.logs import run_logger
from finetune_flows.runtime.launcher import run_worker, torchrun_log_dir
from finetune_flows.training.checkpoints import checkpoint_is_complete


def ranks_per_node(cfg: FinetuneConfig, plan: Plan) -> int:
    h = cfg.hardware
    if h.launcher == "ray":
        return h.gpus_per_node or 1
    return plan.nproc


def world_size(cfg: FinetuneConfig, plan: Plan) -> int:
    return cfg.hardware.nodes * ranks_per_node(cfg, plan)


def fingerprint_parts(cfg: FinetuneConfig, plan: Plan) -> list[Any]:
    """What the launch adds to the training fingerprint. Nothing for DDP on one torchrun host, so the cache keys of
    single-host runs stay as they were; the world size otherwise (it changes the data order and the result), and
    the strategy under FSDP (another reduction order)."""
    h = cfg.hardware
    sharded = ["fsdp"] if plan.strategy == "fsdp" else []
    if h.launcher == "torchrun" and h.nodes == 1:
        return sharded
    return [h.launcher, h.nodes, ranks_per_node(cfg, plan), *sharded]


def plan_problems(cfg: FinetuneConfig, plan: Plan) -> list[str]:
    """Launch settings that contradict what this host resolved."""
    import importlib.util

    h = cfg.hardware
    if h.launcher == "ray" and importlib.util.find_spec("ray") is None:
        return ["hardware.launcher=ray needs Ray Train on this host: pip install '.[ray]'"]
    if h.launcher == "torchrun" and h.gpus_per_node is not None and h.gpus_per_node != plan.nproc:
        what = f"hardware.gpus={h.gpus} selects {plan.nproc} GPU(s)" if plan.device == "cuda" else (
            f"hardware.cpu_processes={h.cpu_processes}")
        return [f"hardware.gpus_per_node={h.gpus_per_node}, but on this node {what}; torchrun starts one rank per "
                "selected GPU"]
    return []


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask (a container's cpuset), lowered by a cgroup v2 CPU quota
    (`cpu.max`, a container's --cpus) where one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def oversubscribed_cores(cfg: FinetuneConfig, plan: Plan, cores: int | None = None) -> str | None:
    """A warning where more CPU ranks start on this host than it has cores (None otherwise, and on GPUs). Not refused:
    it is slow, not wrong. Nor is host memory checked: what a rank's model costs there is known only once it is
    loaded (dtype, quantization, and pages of the checkpoint file the ranks may share), not from the config."""
    if plan.device != "cpu" or cfg.hardware.launcher != "torchrun":
        return None
    cores = usable_cores() if cores is None else cores
    if plan.nproc <= cores:
        return None
    holds = "the whole model" if plan.strategy == "ddp" else "the model to shard it"
    return (f"hardware.cpu_processes={cfg.hardware.cpu_processes} starts {plan.nproc} training ranks on "
            f"{cores} CPU core(s) here: each rank loads {holds} and computes on its own thread, so they take "
            f"turns on the cores and every optimizer step waits for the slowest; set hardware.cpu_processes to at "
            f"most {cores}")


def torchrun_command(module: str, job_path: Path, cfg: FinetuneConfig, plan: Plan, run_id: str) -> list[str]:
    h = cfg.hardware
    head = [sys.executable, "-m", "torch.distributed.run", torchrun_log_dir(job_path)]
    tail = ["-m", module, str(job_path)]
    if h.nodes == 1:
        return head + ["--standalone", f"--nproc_per_node={plan.nproc}"] + tail
    # --max-restarts=0: a dead rank fails the attempt on every node; Prefect's retry resumes from the checkpoint.
    return head + [f"--nnodes={h.nodes}", f"--nproc-per-node={plan.nproc}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={h.rdzv_endpoint}", f"--rdzv-id={run_id}", "--max-restarts=0",
                   f"--rdzv-conf=join_timeout={h.rdzv_timeout_seconds}"] + tail


# torchrun's own join_timeout bounds the wait for nodes that never join, not its connection to the endpoint (a port
# held by a program that never answers blocked it for minutes): the launcher stops it this long after the timeout
RENDEZVOUS_MARGIN = 30.0


def run_ranks(cfg: FinetuneConfig, plan: Plan, job_path: Path, run_id: str, env: dict[str, str], workdir: Path,
              **worker: Any) -> dict[str, Any]:
    """run_worker of the training command; across torchrun nodes, with the rendezvous wait logged and bounded, and
    its failure raised as RendezvousFailed naming the endpoint."""
    h = cfg.hardware
    command = train_command(cfg, plan, job_path, run_id)
    if h.launcher != "torchrun" or h.nodes == 1:
        return run_worker("train", command, env, workdir, **worker)
    where = f"the c10d rendezvous at {h.rdzv_endpoint} (id {run_id[:12]})"
    run_logger().info("waiting for all %d nodes at %s, at most %d s (hardware.rdzv_timeout_seconds)", h.nodes, where,
                      h.rdzv_timeout_seconds)
    try:
        return run_worker("train", command, env, workdir, start_within=h.rdzv_timeout_seconds + RENDEZVOUS_MARGIN,
                          on_start=lambda: run_logger().info("the %d nodes met at %s: ranks starting", h.nodes,
                                                             where), **worker)
    except WorkerFailed as exc:
        if not isinstance(exc, WorkerStartTimeout) and "torch.distributed.elastic.rendezvous" not in exc.tail:
            raise
        raise RendezvousFailed(exc.step, exc.returncode, exc.tail, (
            f"hardware.nodes={h.nodes}: the nodes did not all meet at {where} within {h.rdzv_timeout_seconds} s "
            "(hardware.rdzv_timeout_seconds). Start this flow with the same config on every node, and check that "
            f"{h.rdzv_endpoint} is reachable from each of them and its port is not held by another program")) from None


def train_command(cfg: FinetuneConfig, plan: Plan, job_path: Path, run_id: str) -> list[str]:
    """The process the training step starts: torchrun of the rank body, the Ray Train driver, or for one CPU rank
    the rank body itself (it sets up what torchrun would give it, `single_rank_defaults`), which the launcher can
    fork from its pre-imported fork server (runtime/forkserver.py) instead of starting two fresh interpreters."""
    if cfg.hardware.launcher == "ray":
        return [sys.executable, "-m", "finetune_flows.training.ray_worker", str(job_path)]
    if plan.device == "cpu" and plan.nproc == 1 and cfg.hardware.nodes == 1:
        return [sys.executable, "-m", "finetune_flows.training.worker", str(job_path)]
    return torchrun_command("finetune_flows.training.worker", job_path, cfg, plan, run_id)


def single_rank_defaults() -> None:
    """A rank started without torchrun (one CPU rank, or by hand) gets the variables torchrun would set for a world
    of one: rank 0 of 1, hosting the process group's store on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:  # the port is free now; torchrun --standalone picks its port the same way
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


# ------------------------------------------------------------------ inside the ranks


def _group_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (just `[obj]` without a process group)."""
    if not _group_ready():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if _group_ready():
        import torch.distributed as dist

        dist.barrier()


def storage_is_shared(out: Path) -> bool:
    """Whether every rank sees the same `out` directory: each rank drops a marker there, and each checks that it
    sees all of them. True on one host; False when nodes write to their own disks."""
    if not _group_ready():
        return True
    probes = out / "ranks"
    probes.mkdir(parents=True, exist_ok=True)
    mine = probes / f".probe-{secrets.token_hex(8)}"
    mine.touch()
    try:
        names = gather(mine.name)  # a collective: every marker exists once it returns
        return all(gather(all((probes / n).exists() for n in names)))
    finally:
        mine.unlink(missing_ok=True)


def is_writer(shared: bool) -> bool:
    """The rank that writes the adapter and the run's metrics: global rank 0, or each node's local rank 0 when
    the nodes do not share the output directory (so every node ends with the result, like the Trainer's
    `save_on_each_node`)."""
    return int(os.environ.get("LOCAL_RANK" if not shared else "RANK", 0)) == 0


def checkpoint_step(path: Path) -> int:
    return int(json.loads((path / "trainer_state.json").read_text())["global_step"])


def complete_checkpoints(ckpt_dir: Path) -> dict[int, Path]:
    """This rank's view of the complete checkpoints (manifest and every file present), by step."""
    found = {}
    for path in ckpt_dir.glob("checkpoint-*") if ckpt_dir.is_dir() else []:
        if checkpoint_is_complete(path):
            found[checkpoint_step(path)] = path
    return found


def agreed_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint that every rank can load. With a shared directory that is simply the newest; with
    one directory per node, a node that crashed while saving step 20 may have only step 10, so all resume from 10
    (or from scratch when they share none)."""
    local = complete_checkpoints(ckpt_dir)
    common = set.intersection(*(set(steps) for steps in gather(sorted(local))))
    if not common:
        return None
    return local[max(common)]


def prepare_ranks(trainer, out: Path) -> tuple[bool, Path | None]:
    """Every rank, once the Trainer (and so the process group) exists: find out whether the output directory is
    shared (if not, the Trainer saves checkpoints on each node), hook in Ray Train's reporting when running under
    it, and choose the checkpoint every rank resumes from. Returns (shared, resume)."""
    shared = storage_is_shared(out)
    trainer.args.save_on_each_node = not shared
    ckpt_dir = Path(trainer.args.output_dir)
    if in_ray_worker():
        trainer.add_callback(report_callback())
        return shared, newest_checkpoint(ray_checkpoint(), agreed_checkpoint(ckpt_dir))
    return shared, agreed_checkpoint(ckpt_dir)


def newest_checkpoint(*found: Path | None) -> Path | None:
    """The checkpoint of the highest step among those found (the first on a tie). Under Ray both are looked at: Ray
    Train's newest checkpoint is the newest its controller had registered, which lags the workers' reports, so a run
    stopped just after a save knew checkpoints Ray did not, and resumed further back than the run's own."""
    return max((p for p in found if p is not None), key=checkpoint_step, default=None)


# ---------------------------------------------------------------- under Ray Train (hardware.launcher: ray)


def report_callback():
    """The Trainer's Ray integration, with the checkpoint reported by rank 0 alone. Under DDP every rank holds
    the same checkpoint; if each reported its own copy, a rank that looked before the new checkpoint was on disk
    would merge the previous step's files into it. Every rank's RNG state is already in the copy: the training
    worker's own `on_save` (training/worker.py, a callback added before this one) waits for every rank."""
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback

    class RankZeroReport(RayTrainReportCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                return super().on_save(args, state, control, **kwargs)
            ray.train.report(metrics={"step": state.global_step}, checkpoint=None)  # report is collective

    return RankZeroReport()


def ray_checkpoint() -> Path | None:
    """Inside a Ray Train worker: the newest checkpoint Ray persisted for this run (None on a first attempt)."""
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    return Path(checkpoint.path) / RayTrainReportCallback.CHECKPOINT_NAME


def in_ray_worker() -> bool:
    if "ray" not in sys.modules:
        return False
    import ray.train

    try:
        ray.train.get_context()
        return True
    except Exception:  # outside a Ray Train worker
        return False
