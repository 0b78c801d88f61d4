"""`hardware.strategy: fsdp`: FSDP2-QLoRA, the 4-bit base sharded across the ranks through the Trainer's FSDP2.

How a 4-bit base becomes shardable:
- bitsandbytes keeps the packed 4-bit weights in a tensor of dtype `bnb_4bit_quant_storage`. FSDP2 all-gathers a
  unit's parameters in the mixed-precision parameter dtype (the compute dtype) and casts floating parameters of
  any other dtype: a bf16 cast of bytes stored as fp32 would destroy them, and accelerate leaves integer (uint8)
  storage unsharded on every rank. So when the plan shards, the quantize step stores the 4-bit weights in the
  compute dtype (bf16 on GPUs, fp32 on the CPU; part of its cache key), and the frozen embeddings and norms stay in
  the compute dtype too (`train.upcast_frozen` is off): every parameter of a unit is gathered in one dtype.
- The LoRA weights stay fp32 master weights as under DDP (PEFT casts adapters of a bf16 base up); FSDP2 gathers
  them in the compute dtype with the rest of their unit and reduce-scatters their gradients in fp32.
- Units (accelerate's FSDP2 split): one per decoder layer (the model's `_no_split_modules`), the embeddings, and
  the final norm with the lm_head.
- Checkpoints: the Trainer's FSDP checkpoint (adapter-only `pytorch_model_fsdp.bin` and `optimizer.bin`, gathered
  on rank 0, which is all a resume reads) plus the same `adapter_model.safetensors` as under DDP. That file is
  gathered here from the trainable parameters alone: the Trainer's own FSDP save gathers the whole model, 4-bit
  base included, onto rank 0 at every checkpoint, and on the CPU the tensors it returns share storage that FSDP
  frees (safetensors then fails on them).
- On the CPU: accelerate 1.15 (`AcceleratorState.__init__` in accelerate/state.py) switches to
  `DistributedType.FSDP` only for accelerator device types (MULTI_GPU, MULTI_XPU, ...), never MULTI_CPU, so the
  Trainer's `fsdp` setting is silently dropped and CPU ranks would train with DDP. The sharded Trainer makes the
  switch accelerate makes on GPUs (its plugin on the state, the FSDP type on both shared states), so CPU ranks
  over gloo run the real FSDP2 path: sharded `Params4bit`, all-gathers, reduce-scatters, FSDP checkpoints.
"""

from __future__ import annotations

from typing import Any

from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.models.sources import readable_shape
from finetune_flows.training.planner import GIB, ModelShape, peak_bytes, planning_bytes
from finetune_flows.errors import UserInputError

MIB = 2**20


def quant_storage(strategy: str, compute_dtype: str) -> str:
    """The dtype bitsandbytes stores packed 4-bit weights in: the compute dtype when they are sharded."""
    return compute_dtype if strategy == "fsdp" else "uint8"


def readable_model_shape(source: str, trust_remote_code: bool = False) -> ModelShape | None:
    """The model's shape where its config can be read before anything is downloaded or converted (None where it
    cannot yet)."""
    shape = readable_shape(source, trust_remote_code)
    return None if shape is None else ModelShape.from_config(shape)


def resolve_strategy(cfg: FinetuneConfig, *, on_gpu: bool, ranks: int, free_mib: int | None,
                     dtype_bytes: int) -> tuple[str, str]:
    """(ddp | fsdp, why) for `hardware.strategy` on this machine; `ranks` is the world size of the run, `free_mib`
    the least free memory of its GPUs (the planner's share of it, or of `hardware.memory_budget_gib`)."""
    wanted = cfg.hardware.strategy
    if ranks == 1 and wanted != "ddp":
        return "ddp", (f"hardware.strategy={wanted} with a single rank: nothing to shard, training with ddp")
    if wanted != "auto":
        return wanted, f"hardware.strategy={wanted}"
    if not on_gpu or free_mib is None:
        return "ddp", "auto: ddp on the CPU (no device memory to save)"
    if cfg.train.upcast_frozen is True:
        return "ddp", "auto: ddp, since train.upcast_frozen=true keeps frozen weights in fp32 (fsdp cannot)"
    shape = readable_model_shape(cfg.model.source, cfg.model.trust_remote_code)
    if shape is None:
        return "ddp", ("auto: ddp, the model's shape cannot be read before it is fetched; set "
                       "hardware.strategy=fsdp to shard it")
    budget = planning_bytes(free_mib, cfg.hardware.memory_budget_gib)[0]
    common = dict(checkpointing=True, four_bit=cfg.quantization.load_in_4bit, lora_r=cfg.lora.r,
                  lora_targets=cfg.lora.target_modules, fused_ce=False, dtype_bytes=dtype_bytes, upcast=False)
    whole = peak_bytes(shape, cfg.data.max_length, **common)
    if whole <= budget:
        return "ddp", (f"auto: ddp, the model and a {cfg.data.max_length}-token micro-batch need "
                       f"{whole / GIB:.1f} GiB of the {budget / GIB:.1f} GiB budget per GPU")
    sharded = peak_bytes(shape, cfg.data.max_length, shards=ranks, **common)
    return "fsdp", (f"auto: fsdp, the model and a {cfg.data.max_length}-token micro-batch need {whole / GIB:.1f} "
                    f"GiB on one GPU (budget {budget / GIB:.1f} GiB), {sharded / GIB:.1f} GiB sharded over {ranks}")


# ------------------------------------------------------------------ inside the ranks


def trainer_kwargs(model) -> dict[str, Any]:
    """TrainingArguments for FSDP2: one unit per decoder layer, the full (gathered) state dict type."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = list(getattr(inner, "_no_split_modules", None) or [])
    if not layers:
        raise RuntimeError(f"{type(inner).__name__} names no decoder layer class (_no_split_modules) to shard by")
    return {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": layers,
                                          "reshard_after_forward": True, "state_dict_type": "FULL_STATE_DICT",
                                          "cpu_ram_efficient_loading": False}}


def gather_adapter(model) -> dict | None:
    """The trainable parameters as full tensors on the CPU, on every rank (a collective: every rank calls it, in
    the same order). None when the model is not sharded (its own save_pretrained then reads it)."""
    from torch.distributed.tensor import DTensor

    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not any(isinstance(p, DTensor) for _, p in trainable):
        return None
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
            for name, p in trainable}


def local_parameter_mib(model) -> float:
    """MiB of parameters this rank holds (its shards under FSDP, everything under DDP)."""
    from torch.distributed.tensor import DTensor

    local = (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in local) / MIB


def trainer_class(compute_dtype: str):
    """The Trainer with the FSDP2 details above: the mixed-precision policy, FSDP on CPU ranks, the adapter save."""
    import torch
    from transformers import Trainer

    compute = getattr(torch, compute_dtype)

    class ShardedTrainer(Trainer):
        def __init__(self, *args, **kwargs):
            training_args = kwargs["args"]
            # gather in the compute dtype (the 4-bit storage dtype), reduce the fp32 LoRA gradients in fp32
            training_args.fsdp_plugin_args["mixed_precision_policy"] = {
                "param_dtype": compute, "reduce_dtype": torch.float32, "output_dtype": compute}
            super().__init__(*args, **kwargs)
            if not self.is_fsdp_enabled:
                self._fsdp_on_cpu_ranks()

        def _fsdp_on_cpu_ranks(self) -> None:
            from accelerate.state import PartialState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            state = self.accelerator.state
            if state.distributed_type != DistributedType.MULTI_CPU:
                raise RuntimeError(f"FSDP was not enabled for distributed type {state.distributed_type}")
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.distributed_type = DistributedType.FSDP
            # a later AcceleratorState() copies PartialState's type over its own: set both, as accelerate does
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True

        def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
            state_dict = gather_adapter(self.model)
            if self.args.should_save:
                self._save(output_dir or self.args.output_dir, state_dict=state_dict)

    return ShardedTrainer


def check_storage(shared: bool) -> None:
    """FSDP checkpoints are written by global rank 0 and read back through it; nodes that do not share the output
    directory would resume from different files (and the ranks would disagree on the collectives to run)."""
    if not shared:
        raise UserInputError("hardware.strategy=fsdp across nodes needs an output directory (run.cache_dir) that "
                             "every node shares: FSDP checkpoints are written and read through global rank 0")
