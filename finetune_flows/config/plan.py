"""The plan: every `auto` of the config made concrete for this machine and its GPU selection, in one object.

`Plan` is resolved once per run (finetune_flows/runtime/environment.py `resolve_plan`, when the environment is
verified), refined by the memory planner before the training worker starts (`Plan.training`), and it is what every
worker receives: a job file holds `plan` and `worker_config(...)`, the config with each `auto` replaced by the
plan's value. What only a worker can decide is a resolved mode here, never `auto`: `compile: deferred`
compiles the layers once the first steps show the run repays it (finetune_flows/training/compiling.py).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import BaseModel

from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.errors import UserInputError
from finetune_flows.training.planner import TrainingPlan

CompileMode = Literal["off", "start", "deferred"]  # never; before the first step; once the first steps show it pays


class Plan(BaseModel):
    """The config's `auto` choices made concrete for this machine and GPU selection."""

    device: str  # "cuda" or "cpu"
    nproc: int
    precision: str  # bf16 | fp16 | fp32
    compute_dtype: str  # bfloat16 | float16 | float32
    train_attn: str
    eval_attn: str
    eval_dtype: str = ""  # compute dtype of the static/continuous evaluation engines ("" = compute_dtype)
    eval_engine: str = "static"  # static | continuous | generate (eval.engine resolved)
    attention_choice: dict[str, str] = {}  # purpose -> why that backend (measured timings, configured, CPU)
    strategy: str = "ddp"  # ddp | fsdp (hardware.strategy resolved: finetune_flows/training/sharding.py)
    strategy_choice: str = ""  # why
    liger: bool = False  # train.liger_kernel resolved
    upcast_frozen: bool = False  # train.upcast_frozen resolved
    dequantize_base: bool = False  # train.dequantize_base resolved; the memory planner may keep the base 4-bit
    compile: CompileMode = "off"  # train.compile resolved; the memory planner may turn it off
    training: TrainingPlan | None = None  # the memory planner's micro-batch, accumulation, checkpointing, base

    def with_training(self, training: TrainingPlan) -> Plan:
        """The plan the training worker receives: refined by the memory planner's choice."""
        compile_mode = "off" if not training.compile_layers else "deferred" if training.compile_deferred else "start"
        return self.model_copy(update={"training": training, "dequantize_base": training.dequantize_base,
                                       "compile": compile_mode})


def liger_setting(cfg: FinetuneConfig, device: str) -> bool:
    """`auto`: Liger's kernels on NVIDIA GPUs where liger-kernel is installed."""
    want = cfg.train.liger_kernel
    installed = importlib.util.find_spec("liger_kernel") is not None
    if want is True and not installed:
        raise UserInputError("train.liger_kernel=true, but liger-kernel is not installed (pip install .[gpu])")
    return device == "cuda" and installed and want in (True, "auto")


CHUNK_SIZES_SINCE = "0.8.5"  # the first liger-kernel whose fused loss takes `chunk_mem_const` (loss_chunks.py)


def takes_chunk_sizes(version: str | None) -> bool:
    """Whether a liger-kernel of `version` sizes its loss chunks (`chunk_mem_const`); None: not installed."""
    from packaging.version import Version

    return version is not None and Version(version) >= Version(CHUNK_SIZES_SINCE)


def loss_chunk_setting(cfg: FinetuneConfig, liger: bool, version: str | None) -> int | str | None:
    """train.loss_chunk_tokens as the installed liger-kernel (`version`) can honour it, for the memory planner: `auto`
    keeps Liger's own chunks on a Liger that cannot size them; a size asked for there is refused before any model
    loads."""
    want = cfg.train.loss_chunk_tokens
    if not liger or want is None or takes_chunk_sizes(version):
        return want
    if want == "auto":
        return None
    raise UserInputError(f"train.loss_chunk_tokens={want} needs liger-kernel >= {CHUNK_SIZES_SINCE} (it sizes the "
                         f"fused loss's chunks); installed: {version}. Upgrade it (pip install .[gpu]) or set "
                         "train.loss_chunk_tokens to auto or null")


# A step of a small model on a GPU is bound by the host's kernel launches, which holding the base dequantized (no
# per-call dequantization) and compiling the layers both cut, at the same eval loss (benchmarks/results/
# train-bench-1xGPU-20261201-032103/NOTE.md).
def dequantize_setting(cfg: FinetuneConfig, device: str, strategy: str) -> bool:
    """`auto`: on NVIDIA GPUs under DDP (the planner still keeps the base 4-bit where the copy would not fit); not
    under FSDP, whose point is a sharded 4-bit base, nor on the CPU, where the 4-bit path is what tests exercise."""
    want = cfg.train.dequantize_base
    return want is True or (want == "auto" and device == "cuda" and strategy != "fsdp")


def compile_setting(cfg: FinetuneConfig, device: str, strategy: str) -> CompileMode:
    """`auto`: wherever the base is held dequantized on an NVIDIA GPU (the memory planner leaves layers over a base
    kept 4-bit eager under `auto`: finetune_flows/training/planner.py), deferred until the first steps show the run
    repays the compilation (finetune_flows/training/compiling.py); `true`: before the first step."""
    want = cfg.train.compile
    if want is True:
        return "start"
    return "deferred" if want == "auto" and device == "cuda" and dequantize_setting(cfg, device, strategy) else "off"


def upcast_setting(cfg: FinetuneConfig) -> bool:
    """`auto`: frozen weights in the compute dtype: the same eval loss as PEFT's fp32 upcast at less memory and
    GPU time (the upcast makes every activation fp32: benchmarks/README.md)."""
    want = cfg.train.upcast_frozen
    return False if want == "auto" else bool(want)


def training_settings(cfg: FinetuneConfig, device: str, strategy: str) -> dict[str, Any]:
    """The plan's training fields (Liger, upcast, dequantize, compile) for this device and strategy."""
    return {"liger": liger_setting(cfg, device), "upcast_frozen": upcast_setting(cfg),
            "dequantize_base": dequantize_setting(cfg, device, strategy),
            "compile": compile_setting(cfg, device, strategy)}


def worker_config(cfg: FinetuneConfig, plan: Plan, gpu_ids: list[int], data_format: str | None = None) -> dict:
    """The config as a job file holds it: each `auto` replaced by what the plan resolved it to. Sections whose
    `auto` the plan cannot know yet stay out of the jobs of workers that never read them: `train` until the memory
    planner has run (`plan.training`), `data` until the dataset is prepared (`data_format`); so does
    `hardware.ray_address` (Ray's own `auto` keyword, which ray.init resolves) outside the Ray launcher."""
    out = cfg.model_dump(mode="json")
    hw, q, ev = out["hardware"], out["quantization"], out["eval"]
    hw.update(gpus=",".join(map(str, gpu_ids)) or "cpu", attn_implementation=plan.train_attn, strategy=plan.strategy)
    if hw["launcher"] != "ray":
        del hw["ray_address"]
    q["compute_dtype"] = plan.compute_dtype
    ev.update(engine=plan.eval_engine, dtype=plan.eval_dtype or plan.compute_dtype, attn_implementation=plan.eval_attn)
    if data_format is None:
        del out["data"]
    else:
        out["data"]["format"] = data_format
    if plan.training is None:
        del out["train"]
    else:
        t = plan.training
        out["train"].update(
            precision=plan.precision, liger_kernel=plan.liger, upcast_frozen=plan.upcast_frozen,
            dequantize_base=t.dequantize_base, compile=t.compile_layers, cuda_graphs=t.cuda_graphs,
            gradient_checkpointing=t.gradient_checkpointing, micro_batch_tokens=t.micro_batch_tokens or None,
            loss_chunk_tokens=t.loss_chunk_tokens)
    return out
