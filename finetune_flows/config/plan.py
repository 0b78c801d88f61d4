"""The plan: the config's `auto` settings made concrete for this machine and its GPU selection.

`Plan` is resolved once per run (finetune_flows/runtime/environment.py `resolve_plan`) and handed to every step
and worker; the `*_setting` functions resolve the training settings whose `auto` depends on it.
"""

from __future__ import annotations

import importlib.util

from pydantic import BaseModel

from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.errors import UserInputError


class Plan(BaseModel):
    """The config's `auto` choices made concrete for this machine and GPU selection."""

    device: str  # "cuda" or "cpu"
    gpu_ids: list[int]
    nproc: int
    precision: str  # bf16 | fp16 | fp32
    compute_dtype: str  # bfloat16 | float16 | float32
    train_attn: str
    eval_attn: str
    eval_dtype: str = ""  # compute dtype of the static/continuous evaluation engines ("" = compute_dtype)
    attention_choice: dict[str, str] = {}  # purpose -> why that backend (measured timings, configured, CPU)
    strategy: str = "ddp"  # ddp | fsdp (hardware.strategy resolved: finetune_flows/training/sharding.py)
    strategy_choice: str = ""  # why


def liger_setting(cfg: FinetuneConfig, plan: Plan) -> bool:
    """`auto`: Liger's kernels on NVIDIA GPUs where liger-kernel is installed."""
    want = cfg.train.liger_kernel
    installed = importlib.util.find_spec("liger_kernel") is not None
    if want is True and not installed:
        raise UserInputError("train.liger_kernel=true, but liger-kernel is not installed (pip install .[gpu])")
    return plan.device == "cuda" and installed and want in (True, "auto")


# A step of a small model on a GPU is bound by the host's kernel launches, which holding the base dequantized (no
# per-call dequantization) and compiling the layers both cut, at the same eval loss (benchmarks/results/
# train-bench-1xGPU-20261201-032103/NOTE.md).
def dequantize_setting(cfg: FinetuneConfig, plan: Plan) -> bool:
    """`auto`: on NVIDIA GPUs under DDP (the planner still keeps the base 4-bit where the copy would not fit); not
    under FSDP, whose point is a sharded 4-bit base, nor on the CPU, where the 4-bit path is what tests exercise."""
    want = cfg.train.dequantize_base
    return want is True or (want == "auto" and plan.device == "cuda" and plan.strategy != "fsdp")


def compile_setting(cfg: FinetuneConfig, plan: Plan) -> bool:
    """`auto`: wherever the base is held dequantized on an NVIDIA GPU (compiling needs it: training/planner.py),
    once the first steps show the run repays the compilation (training/compiling.py)."""
    want = cfg.train.compile
    return want is True or (want == "auto" and plan.device == "cuda" and dequantize_setting(cfg, plan))


def upcast_setting(cfg: FinetuneConfig) -> bool:
    """`auto`: frozen weights in the compute dtype: the same eval loss as PEFT's fp32 upcast at less memory and
    GPU time (the upcast makes every activation fp32: benchmarks/README.md)."""
    want = cfg.train.upcast_frozen
    return False if want == "auto" else bool(want)
