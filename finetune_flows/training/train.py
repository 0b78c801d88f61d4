"""Step 5: QLoRA training with peft and the transformers Trainer, launched as `torchrun --nproc_per_node=N`.

Each rank loads the 4-bit checkpoint onto its own device; DDP runs over NCCL on GPUs and gloo on the CPU. The
output directory is content-addressed (everything that determines the adapter), so a retry, or a rerun after a
crash, finds the last checkpoint there and resumes with its optimizer, scheduler and RNG state.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from finetune_flows.training.attempts import LAYOUT, kept_layout, run_attempts, split_limit, whole_run
from finetune_flows.orchestration.concurrency import device_slots
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.data.dataset import PreparedDataset
from finetune_flows.training.distributed import fingerprint_parts, oversubscribed_cores, run_ranks, world_size
from finetune_flows.config.plan import Plan, loss_chunk_setting, worker_config
from finetune_flows.errors import UserInputError
from finetune_flows.store.fingerprint import combine, step_versions
from finetune_flows.runtime.gpus import GpuSelection
from finetune_flows.runtime.launcher import compile_caches, gpu_models, training_env, write_job
from finetune_flows.logs import run_logger
from finetune_flows.packages import installed_version
from finetune_flows.training.planner import (
    ModelShape, TrainingPlan, plan_training, planning_bytes,
)
from finetune_flows.config.preflight import check_lora_targets
from finetune_flows.reporting.progress import ProgressReporter
from finetune_flows.models.quantize import QuantizedModel
from finetune_flows.store.entries import Entry, reuse_or_produce, step_state
from finetune_flows.training.checkpoints import last_checkpoint

# train.* settings that cannot change the adapter: bookkeeping, checkpoint cadence (a resume restores the
# optimizer, scheduler and RNG state, so where it resumes from does not change the result) and retries. Every
# other train.* setting is part of the adapter's cache key; extend this set only with settings that provably do
# not change the trained weights.
TRAIN_KEYS_NOT_IN_CACHE_KEY = frozenset({"logging_steps", "save_steps", "save_total_limit", "retries",
                                         "retry_delay_seconds"})
# What a finished entry holds; checkpoints stay beside it (a later attempt resumes from them) but are not part
# of the output.
TRAIN_OUTPUTS = ("adapter", "train_metrics.json")


class TrainResult(BaseModel):
    adapter_path: Path
    output_dir: Path
    fingerprint: str
    steps: int
    world_size: int
    device: str
    loss_curve: list[tuple[int, float]]  # (step, loss)
    first_loss: float
    final_loss: float
    # tokens, seconds and tokens/s over all attempts (a resumed run repeats the steps after its checkpoint; the
    # figures count that work too); the last attempt's own figures and its steady state beside them
    tokens_per_second: float  # real (non-padding) tokens over all ranks / training seconds, all attempts
    train_tokens: int
    train_seconds: float
    peak_memory_mb: float  # max over ranks: CUDA max reserved, or process max RSS on CPU
    resumed_from_step: int | None
    backend: str | None = None  # torch.distributed backend (nccl on GPUs, gloo on the CPU)
    strategy: str = "ddp"  # ddp | fsdp (hardware.strategy as resolved)
    rank_steps: list[int] = []  # optimizer steps each rank finished (equal under DDP)
    devices: list[str] = []  # device name per rank
    rank_tokens: list[int] = []  # real tokens each rank trained on (packing balances them)
    rank_param_mb: list[float] = []  # MiB of parameters each rank holds (its shards under fsdp)
    peak_allocated_mb: float | None = None
    steady_tokens_per_second: float | None = None  # median over windows after warm-up, save steps left out
    steady_state: dict[str, Any] = {}
    training_plan: TrainingPlan | None = None
    micro_batch_split: int = 1
    layout: str = ""
    last_attempt_tokens: int | None = None
    last_attempt_seconds: float | None = None
    last_attempt_tokens_per_second: float | None = None
    compiled_at_step: int | None = None  # decoder layers compiled before this step (0: from the start; None: eager)
    compile_seconds: float | None = None  # measured, where train.compile=auto compiled during the run
    compile_stats: dict[str, Any] | None = None  # what torch.compile did on rank 0 (compiling.compile_stats)
    peak_process_memory_mb: float | None = None  # max over ranks: the process's GPU memory as NVML sees it
    attempts: list[dict[str, Any]] = []  # every attempt: outcome, split, resumed from, steps, tokens, seconds
    oom_adaptations: list[dict[str, Any]] = []  # each out-of-memory attempt and the split it led to


def train_key_parts(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, plan: Plan) -> dict[str, Any]:
    """Everything the adapter depends on (the README's cache-key table lists the same)."""
    return {"data": data.fingerprint, "base": base.fingerprint, "lora": cfg.lora.model_dump(mode="json"),
            "train": cfg.train.model_dump(mode="json", exclude=set(TRAIN_KEYS_NOT_IN_CACHE_KEY)),
            "ranks": plan.nproc, "device": plan.device, "precision": plan.precision, "attention": plan.train_attn,
            "launch": fingerprint_parts(cfg, plan), **step_versions("train-adapter")}


def train_fingerprint(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, plan: Plan) -> str:
    return combine(train_key_parts(cfg, data, base, plan))


def row_lengths(data: PreparedDataset) -> list[int]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    return pc.list_value_length(pq.read_table(data.path / "train.parquet", columns=["input_ids"])["input_ids"]
                                ).to_pylist()


def training_plan(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, plan: Plan,
                  gpus: GpuSelection) -> TrainingPlan:
    """The memory planner's choice for this model, data and the selected GPUs (finetune_flows/training/planner.py)."""
    lengths = row_lengths(data)
    t = cfg.train
    budget = cfg.hardware.memory_budget_gib
    free = gpus.planning_mib() if plan.device == "cuda" else None
    share = planning_bytes(free, budget)[1]
    try:
        tplan = plan_training(
            ModelShape.from_checkpoint(base.path, cfg.model.trust_remote_code), free_mib=free, max_row=max(lengths),
            mean_row=sum(lengths) / len(lengths), rows_per_step=t.per_device_batch_size * t.gradient_accumulation_steps,
            packing=t.packing, micro_batch_tokens=t.micro_batch_tokens, checkpointing=t.gradient_checkpointing,
            four_bit=base.load_in_4bit, lora_r=cfg.lora.r, lora_targets=cfg.lora.target_modules,
            fused_ce=plan.liger,
            loss_chunk_tokens=loss_chunk_setting(cfg, plan.liger, installed_version("liger-kernel")),
            dtype_bytes=2 if plan.compute_dtype != "float32" else 4,
            upcast=plan.upcast_frozen, per_device_rows=t.per_device_batch_size,
            accumulation=t.gradient_accumulation_steps, dequantize=plan.dequantize_base,
            compile_layers=plan.compile != "off", compile_deferred=plan.compile == "deferred",
            cuda_graphs=t.cuda_graphs, ranks=world_size(cfg, plan),
            shards=world_size(cfg, plan) if plan.strategy == "fsdp" else 1, budget_gib=budget,
            fp8_base=t.fp8_base, capabilities=[g.capability for g in gpus.gpus] if plan.device == "cuda" else [],
            compute_dtype=plan.compute_dtype)
    except ValueError as exc:
        raise UserInputError(f"training plan{f' (within {share})' if share else ''}: {exc}") from None
    return tplan


def check_one_step(cfg: FinetuneConfig, data: PreparedDataset, tplan: TrainingPlan, world: int) -> None:
    """Refuse, before any rank starts and loads the model, training data whose packs cannot fill one optimizer step
    on every rank (more ranks than packs): each rank would load the model only to fail on it."""
    if not tplan.packing:
        return
    from finetune_flows.data.packing import first_packs  # here: packing imports transformers, which the flow need not

    try:
        first_packs(row_lengths(data), tplan.micro_batch_tokens, tplan.gradient_accumulation_steps, world,
                    cfg.train.seed)
    except ValueError as exc:
        raise UserInputError(
            f"training data: {exc}. Train on fewer ranks (hardware.cpu_processes on the CPU, hardware.gpus), with a "
            "smaller train.per_device_batch_size or train.gradient_accumulation_steps, or on more rows") from None


# The plan's figures are each rank's; the one a reader would take for the whole optimizer step says so
PLAN_LABELS = {"tokens_per_step": "tokens_per_step (per rank)"}


def publish_training_plan(tplan: TrainingPlan, cached: bool = False) -> None:
    """The plan in the run's log and as the `training-plan` artifact; `cached`: the plan a reused adapter was trained
    with, which this machine's free memory today may not repeat."""
    whose = " (the cached adapter's)" if cached else ""
    run_logger().info("training plan%s: %s", whose, "; ".join(tplan.reasons))
    from prefect.artifacts import create_markdown_artifact

    lines = ["| choice | value |", "|---|---|"]
    lines += [f"| {PLAN_LABELS.get(k, k)} | {round(v, 2) if isinstance(v, float) else v} |"
              for k, v in tplan.model_dump().items() if k != "reasons"]
    md = f"# Training plan{whose}\n\n" + "\n".join(lines) + "\n\n" + "\n".join(f"- {r}" for r in tplan.reasons) + "\n"
    try:
        create_markdown_artifact(md, key="training-plan", description="Micro-batch, accumulation, checkpointing")
    except Exception as exc:  # outside a Prefect run
        run_logger().debug("training plan artifact not created: %s", exc)


def write_train_job(out: Path, cfg: FinetuneConfig, plan: Plan, base: QuantizedModel, data: PreparedDataset,
                    gpu_ids: list[int], fingerprint: str, **extra: Any) -> Path:
    """The training worker's job file: the plan (with the memory planner's choice in `plan.training`) and the
    config with every `auto` resolved (finetune_flows/config/plan.py)."""
    return write_job(out, "train", config=worker_config(cfg, plan, gpu_ids, data.format),
                     plan=plan.model_dump(mode="json"), out=str(out), base=str(base.path), data=str(data.path),
                     load_in_4bit=base.load_in_4bit, fingerprint=fingerprint, **extra)


# What an unfinished attempt leaves for the next one: the checkpoints it resumes from (torchrun's, and Ray Train's
# run storage under ray/), the log, and the whole-run accounting (finetune_flows/training/attempts.py).
RESUMABLE = ("checkpoints", "ray", "train.log", "attempts.json", "adapt.json", LAYOUT)


def train_adapter(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, plan: Plan, gpus: GpuSelection,
                  run_dir: Path):
    """Reuse the verified adapter, or train it under the entry's lock (held for the whole attempt, so no other
    run writes the checkpoints it resumes from); a retry resumes from the last complete checkpoint."""
    entry = Entry(cfg.cache_root, "adapters", train_fingerprint(cfg, data, base, plan))
    out = entry.path

    def resume_point() -> int | None:
        resume = last_checkpoint(out / "checkpoints")
        if resume is not None:
            run_logger().warning("found %s from an interrupted attempt: resuming from it", resume)
        return int(resume.name.split("-")[-1]) if resume else None

    def produce() -> TrainResult:
        # planned only for training: a reused adapter reports the plan it was trained with
        tplan = training_plan(cfg, data, base, plan, gpus)
        tplan, least_split = kept_layout(out, tplan, last_checkpoint(out / "checkpoints") is not None)
        planned = plan.with_training(tplan)
        if planned.strategy_choice:
            tplan.reasons.insert(0, planned.strategy_choice)
            if cfg.hardware.strategy == "fsdp" and planned.strategy == "ddp":
                run_logger().warning(planned.strategy_choice)
        publish_training_plan(tplan)
        check_one_step(cfg, data, tplan, world_size(cfg, planned))
        if crowded := oversubscribed_cores(cfg, planned):
            run_logger().warning(crowded)

        def attempt(split: int, observe) -> None:
            job = write_train_job(out, cfg, planned, base, data, gpus.ids, entry.key, micro_batch_split=split,
                                  compile_record={"cache": str(cfg.cache_root), "gpus": gpu_models(gpus)},
                                  workers_lock=str(entry.workers_lock_path))
            with ProgressReporter(cfg.train.max_steps) as progress:
                run_ranks(cfg, planned, job, entry.key, training_env({**gpus.env, **compile_caches(cfg.cache_root,
                                                                                                  gpus)}), out,
                          on_event=lambda event: (observe(event), progress(event)),
                          stop_grace=cfg.hardware.stop_grace_seconds)

        check_lora_targets(base.path, cfg.lora.target_modules, cfg.model.trust_remote_code)  # before torchrun
        limit = split_limit(tplan.packing, tplan.micro_batch_tokens, tplan.micro_batch_rows, max(row_lengths(data)))
        with device_slots(gpus.ids):  # lock order: the entry's lock (held by the caller), then the devices
            run_attempts(out, limit, resume_point, attempt, least_split)
        return TrainResult.model_validate(whole_run(out, json.loads((out / "train_metrics.json").read_text())))

    result, reused = reuse_or_produce(entry, TrainResult, produce, TRAIN_OUTPUTS, keep=RESUMABLE)
    if reused and result.training_plan is not None:
        publish_training_plan(result.training_plan, cached=True)
    return step_state(result, reused, entry)
