"""`hardware.launcher: ray`: the training step on an existing Ray cluster, through Ray Train.

`python -m finetune_flows.training.ray_worker job.json` is the child process the training step starts instead of
torchrun. It connects to the cluster (`ray.init(address=hardware.ray_address)`) and runs a `TorchTrainer` whose
workers (one GPU each, or CPU workers over gloo) execute the same rank body as torchrun's ranks,
`finetune_flows.training.worker`. Ray forwards the workers' output to this driver, so progress events reach the
Prefect logs and the progress artifact as with torchrun. Checkpoints are reported through the Trainer's Ray
integration (`RayTrainReportCallback`) and kept in the run's storage (`<adapter dir>/ray`); a retry of the step
resumes from the newest one. Ray's own restarts are off: a dead worker fails the attempt, and Prefect's retry
(with the device slots held as usual) restarts it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.training.distributed import world_size
from finetune_flows.config.plan import Plan
from finetune_flows.runtime.launcher import COMPILE_CACHES
from finetune_flows.runtime.lifecycle import rank_record, worker_main
from finetune_flows.runtime.ray_cluster import cluster_fits, state_api_problem
from finetune_flows.training.worker import _train

RAY_RUN_NAME = "train"
# Progress events are plain stdout lines: Ray Train's print patch would turn them into log records.
DRIVER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_DEDUP_LOGS": "0"}
# What the training step set for its worker that Ray's workers (started by the raylets, not by this driver) need
# too: the import path, the GPU order, the offline Hub, the allocator, stable hashes, and the compilers' caches in
# the project's cache (shared storage every node reaches, as the run's checkpoints are).
FORWARDED_ENV = ("PYTHONPATH", "TOKENIZERS_PARALLELISM", "CUDA_DEVICE_ORDER", "HF_HUB_OFFLINE",
                 "PYTORCH_CUDA_ALLOC_CONF", "PYTHONHASHSEED", "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
                 *COMPILE_CACHES)


def forwarded_env(environ: dict[str, str]) -> dict[str, str]:
    """The driver's variables that Ray's runtime environment passes on to every training worker."""
    return {k: environ[k] for k in FORWARDED_ENV if k in environ}


def train_loop_per_worker(job: dict) -> None:
    """One Ray Train worker: Ray has set up the process group and RANK/LOCAL_RANK/WORLD_SIZE."""
    import ray.train

    with rank_record(Path(job["workdir"]), ray.train.get_context().get_world_rank()):
        _train(job)


def run_on_ray(job: dict) -> dict:
    """The driver: submit the training function to the cluster and wait for it."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg = FinetuneConfig.model_validate(job["config"])
    plan = Plan.model_validate(job["plan"])
    out = Path(job["out"])
    on_gpu = plan.device == "cuda"
    ray.init(address=cfg.hardware.ray_address, log_to_driver=True,
             runtime_env={"env_vars": forwarded_env(dict(os.environ))})
    try:
        workers = world_size(cfg, plan)
        resources = ray.cluster_resources()
        print(f"Ray cluster at {cfg.hardware.ray_address}: {len(ray.nodes())} node(s), "
              f"{resources.get('GPU', 0):g} GPU(s), {resources.get('CPU', 0):g} CPU(s); starting {workers} "
              f"{'GPU' if on_gpu else 'CPU'} worker(s)", flush=True)
        cluster_fits(workers, resources, on_gpu, cfg.hardware.ray_address)
        if problem := state_api_problem(cfg.hardware.ray_address):
            print(f"warning: {problem}", flush=True)
        TorchTrainer(
            train_loop_per_worker, train_loop_config=job,
            torch_config=TorchConfig(backend="nccl" if on_gpu else "gloo"),
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=on_gpu),
            run_config=RunConfig(name=RAY_RUN_NAME, storage_path=str(out / "ray"),
                                 failure_config=FailureConfig(max_failures=0),
                                 checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.save_total_limit)),
        ).fit()
    finally:
        ray.shutdown()
    return json.loads((out / "train_metrics.json").read_text())


if __name__ == "__main__":
    os.environ.update(DRIVER_ENV)
    worker_main(run_on_ray)
