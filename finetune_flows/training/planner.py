"""The memory planner: how many tokens per micro-batch, how much gradient accumulation, whether to checkpoint.

From the model's shape, the memory it may plan with per GPU (`planning_bytes`: a share of the selected GPUs' free
memory, or of `hardware.memory_budget_gib` where that is less) and the dataset's row lengths it picks the largest packed
micro-batch (in tokens) that fits, then the accumulation that makes each optimizer step cover the effective batch the
config asks for (`per_device_batch_size * gradient_accumulation_steps` rows per rank, converted to tokens with the
mean row length), and turns activation checkpointing on only when even a micro-batch worth running does not fit
without it. Values the user sets explicitly (`train.micro_batch_tokens`, `train.gradient_checkpointing`) win. The
plan records its predicted peak so the run can report prediction against measurement.

The memory model, per rank (bytes):
- frozen base: 4-bit linear weights (0.5 byte/param + block constants), embeddings/lm_head/norms in their dtype;
- LoRA: weights, gradients and AdamW moments in fp32 (16 bytes/param);
- activations saved for backward, per token and layer (no checkpointing): the normed inputs and the residual
  stream, q and k projected, normed and rotated, v, the attention output, the MLP's gate/up/product; with
  checkpointing only each layer's input is kept (plus one layer recomputed at a time);
- logits: with a fused linear cross-entropy (Liger) a bounded chunk, else T x vocab in bf16 + fp32 + grad;
- a fixed reserve for the CUDA context, allocator slack, NCCL buffers and kernels' workspaces.
Under FSDP (`shards` ranks, training/sharding.py) each rank keeps 1/shards of the base and of the LoRA state, plus
the units gathered at a time (the current and the prefetched decoder layer) and the lm_head, which stays gathered from
the end of the forward pass through the start of the backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

GIB = 2**30
# Allocator slack, cuBLAS workspaces, NCCL buffers: with it the prediction matches the allocator's reserved peak.
CONTEXT_RESERVE = 1.5 * GIB
MIB = 2**20
BUDGET_FRACTION = 0.70  # of a GPU's free memory: others may share the GPU and grow after we measured it
# Device memory a process holds outside PyTorch's allocator (the CUDA context, loaded kernels; the measurement:
# benchmarks/results/train-bench-1xGPU-20261204-165245/NOTE.md). Of a declared hardware.memory_budget_gib the
# allocator may hold the rest: the plan is made for it and the workers cap the allocator there, so the whole process
# fits.
OUTSIDE_ALLOCATOR = 1.5 * GIB
# The private memory pool of the decoder layers' CUDA graphs (train.cuda_graphs), above the plan's peak: measured
# +0.9 GiB reserved on the Qwen3-0.6B shape and +1.6 GiB on Qwen3-8B at ~10k-token micro-batches
# (benchmarks/results/train-bench-1xGPU-20261205-021848/NOTE.md).
GRAPH_POOL = 2 * GIB
USEFUL_TOKENS = 4096  # below this a micro-batch underfills a data-centre GPU: worth checkpointing to get there
MAX_MICRO_BATCH_TOKENS = 65536  # beyond this, larger micro-batches no longer speed anything up


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """From Llama-style keys: what models.shapes.config_shape returns, or an ARCHS entry."""
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return cls(hidden=hidden, intermediate=config["intermediate_size"], layers=config["num_hidden_layers"],
                   heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or hidden // heads, vocab=config["vocab_size"],
                   tied=bool(config.get("tie_word_embeddings", False)))

    @classmethod
    def from_checkpoint(cls, path: Path, trust_remote_code: bool = False) -> ModelShape:
        """From a checkpoint's config.json read through transformers' config class (GPT-2 names its keys n_head,
        n_embd, n_layer)."""
        from finetune_flows.models.shapes import checkpoint_shape

        return cls.from_config(checkpoint_shape(path, trust_remote_code))

    @property
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one layer, by module name."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.linear_shapes.values())

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def lora_params(self, r: int, targets: list[str] | str) -> int:
        names = self.linear_shapes if targets == "all-linear" else [t for t in targets if t in self.linear_shapes]
        return self.layers * sum(r * sum(self.linear_shapes[n]) for n in names)

    def flops_per_token(self, seq_len: float) -> float:
        """Training FLOPs per token with a frozen base: forward 2N, backward (input gradients only) 2N, over the
        linear layers and the lm_head, plus causal attention (QK^T and PV, forward and backward)."""
        n = self.linear_params + self.vocab * self.hidden
        attention = 2 * 2 * self.layers * self.heads * self.head_dim * seq_len / 2  # causal: half the scores
        return 4 * n + attention * 3  # attention backward ~2x its forward

    def activation_bytes_per_token(self, checkpointing: bool, dtype_bytes: int, residual_bytes: int) -> float:
        """Bytes saved for backward per token, summed over layers."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # q and k three times each (the projection's output, the normed one, the rotated one the attention kernel
        # keeps), v, the attention's output (o_proj's input), and the MLP's gate, up and their product (without the
        # rotated q/k the prediction fell short: benchmarks/results/train-bench-1xGPU-20261202-230939/NOTE.md).
        per_layer = (4 * h) * residual_bytes + (4 * q + 4 * kv + 3 * i) * dtype_bytes
        if checkpointing:
            return self.layers * h * residual_bytes + per_layer
        return self.layers * per_layer


class TrainingPlan(BaseModel):
    """What the planner chose, and why (published in the training-plan artifact and the run summary)."""

    packing: bool
    micro_batch_tokens: int  # packed tokens per micro-batch (with packing); 0 for padded batches
    micro_batch_rows: int  # padded rows per micro-batch (without packing); 0 with packing
    gradient_accumulation_steps: int
    gradient_checkpointing: bool
    tokens_per_step: float  # target real tokens per optimizer step per rank
    predicted_peak_gib: float
    budget_gib: float | None  # memory the plan may use per GPU (None on the CPU)
    reasons: list[str]
    dequantize_base: bool = False  # hold the NF4 weights dequantized (the same numbers, no per-call dequant)
    compile_layers: bool = False  # torch.compile each decoder layer (fused elementwise, fewer launches)
    compile_deferred: bool = False  # ... only once the first steps show the run repays it (training/compiling.py)
    cuda_graphs: bool = False  # ... replayed as CUDA graphs, every micro-batch padded to micro_batch_tokens
    fp8_base: bool = False  # the dequantized base's matmuls in FP8 (models/float8.py)
    loss_chunk_tokens: int | None = None  # Liger's loss in chunks of at least this many tokens (loss_chunks.py)


def _linear_bytes_per_param(four_bit: bool, dtype_bytes: int) -> float:
    return 0.5 + 0.5 / 64 * 1.0 / 2 if four_bit else dtype_bytes  # nf4 + 8-bit absmax/64


def _base_bytes(shape: ModelShape, four_bit: bool, frozen_bytes: int, dtype_bytes: int) -> float:
    linear = shape.linear_params * _linear_bytes_per_param(four_bit, dtype_bytes)
    return linear + shape.embedding_params * frozen_bytes + shape.layers * 6 * shape.hidden * frozen_bytes


def _sharded_base_bytes(shape: ModelShape, whole: float, shards: int, four_bit: bool, frozen_bytes: int,
                        dtype_bytes: int) -> float:
    layer = sum(a * b for a, b in shape.linear_shapes.values()) * _linear_bytes_per_param(four_bit, dtype_bytes)
    return whole / shards + 2 * layer + shape.vocab * shape.hidden * frozen_bytes


def largest_chunk(tokens: int) -> int:
    """The most tokens a chunk of Liger's fused loss holds under train.loss_chunk_tokens=`tokens`
    (training/loss_chunks.py): twice the power of two at or above it, as Liger rounds each chunk up to one."""
    return 2 * (1 << (tokens - 1).bit_length())


def _logit_bytes_per_token(shape: ModelShape, fused_ce: bool) -> float:
    if fused_ce:
        return 4 * shape.hidden  # chunked: transient logits bounded to a few x hidden per token
    return shape.vocab * (2 + 4 + 4)  # bf16 logits, their fp32 upcast in the loss, and the gradient


def memory_parts(shape: ModelShape, tokens: int, *, checkpointing: bool, four_bit: bool, lora_r: int,
                 lora_targets: list[str] | str, fused_ce: bool, dtype_bytes: int = 2, upcast: bool = True,
                 shards: int = 1, graphs: bool = False, loss_chunk_tokens: int | None = None) -> dict[str, float]:
    """Predicted memory of one rank for a micro-batch of `tokens` packed tokens, in bytes, by part: the frozen base,
    the adapter (weights, gradients, AdamW moments), the activations and logits, the fixed reserve, with `graphs`
    the CUDA graphs' pool, and with `loss_chunk_tokens` (fused loss only) the logits of one larger loss chunk."""
    frozen = 4 if upcast else dtype_bytes
    # with PEFT's fp32 upcast the embeddings hand fp32 to the first norm and bitsandbytes returns each projection in
    # its input's dtype, so every saved activation is fp32 (twice the bytes of bf16)
    act = 4 if upcast else dtype_bytes
    weights = _base_bytes(shape, four_bit, frozen, dtype_bytes)
    lora = 16 * shape.lora_params(lora_r, lora_targets) / shards
    if shards > 1:
        weights = _sharded_base_bytes(shape, weights, shards, four_bit, frozen, dtype_bytes)
    per_token = shape.activation_bytes_per_token(checkpointing, act, act)
    per_token += _logit_bytes_per_token(shape, fused_ce)
    parts = {"base": weights, "adapter": lora, "activations": tokens * per_token, "reserve": CONTEXT_RESERVE}
    if fused_ce and loss_chunk_tokens:
        parts["loss_chunk"] = largest_chunk(loss_chunk_tokens) * shape.vocab * dtype_bytes  # its bf16 logits
    return parts | ({"cuda_graphs": GRAPH_POOL} if graphs else {})


def peak_bytes(shape: ModelShape, tokens: int, **kw) -> float:
    """Predicted peak memory of one rank for a micro-batch of `tokens` packed tokens (memory_parts' keywords)."""
    return sum(memory_parts(shape, tokens, **kw).values())


def allocator_bytes(budget_gib: float) -> float:
    """What PyTorch's allocator may hold under `hardware.memory_budget_gib`: the budget less OUTSIDE_ALLOCATOR."""
    return budget_gib * GIB - OUTSIDE_ALLOCATOR


def planning_bytes(free_mib: int | None, budget_gib: float | None = None) -> tuple[float | None, str]:
    """The bytes a plan may use per GPU, and what they are: BUDGET_FRACTION of the free memory, or the allocator's
    share of `hardware.memory_budget_gib` (allocator_bytes) where that is less; (None, "") on the CPU."""
    if free_mib is None:
        return None, ""
    free = free_mib * MIB * BUDGET_FRACTION
    if budget_gib is None or free <= allocator_bytes(budget_gib):
        return free, f"{BUDGET_FRACTION:.0%} of the free memory"
    outside = f"{OUTSIDE_ALLOCATOR / GIB:.1f} GiB outside the allocator"
    return allocator_bytes(budget_gib), f"hardware.memory_budget_gib={budget_gib:g} less {outside}"


AUTO_LOSS_CHUNK_TOKENS = 1024
"""The loss chunks `train.loss_chunk_tokens: auto` asks for: the size measured fastest on the Qwen3-0.6B shape
(docs/gpus.md, the loss in larger chunks)."""


FP8_GRAPHS_MEASURED = "benchmarks/results/train-bench-1xGPU-20261206-130225/NOTE.md"


def plan_training(shape: ModelShape, *, fp8_base: bool = False, capabilities: Sequence[tuple[int, int]] = (),
                  compute_dtype: str = "bfloat16", **batches) -> TrainingPlan:
    """The plan of _plan_with_chunks (its keywords: `batches`) with the base's matmuls in FP8 where asked for
    (`fp8_base`) and possible on GPUs of these `capabilities` (with_fp8_base). An FP8 plan with activation
    checkpointing leaves CUDA graphs out: together the three overran the plan where any two did not
    (FP8_GRAPHS_MEASURED)."""
    def planned(**changed) -> TrainingPlan:
        return with_fp8_base(_plan_with_chunks(shape, **(batches | changed)), fp8_base, list(capabilities),
                             compute_dtype)

    plan = planned()
    if not (plan.fp8_base and plan.cuda_graphs and plan.gradient_checkpointing):
        return plan
    plan = planned(cuda_graphs=False)
    plan.reasons.append(f"CUDA graphs off (train.cuda_graphs={str(batches.get('cuda_graphs')).lower()}): with the "
                        f"FP8 base and activation checkpointing their first passes use more memory than planned "
                        f"({FP8_GRAPHS_MEASURED})")
    return plan


def _plan_with_chunks(shape: ModelShape, *, loss_chunk_tokens: int | str | None = None,
                      **batches) -> TrainingPlan:
    """The plan of _plan_with_graphs (its keywords: `batches`) with Liger's loss in chunks of at least
    `loss_chunk_tokens` tokens (training/loss_chunks.py). `auto`: AUTO_LOSS_CHUNK_TOKENS where Liger's fused loss
    runs and the larger chunk's logits leave the plan's micro-batches, checkpointing, base and graphs as they are
    without it; else Liger's own chunks."""
    if loss_chunk_tokens != "auto":
        plan = _plan_with_graphs(shape, loss_chunk_tokens=loss_chunk_tokens, **batches)
        chunks = loss_chunk_tokens if batches.get("fused_ce") else None
        return plan.model_copy(update={"loss_chunk_tokens": chunks})
    plain = _plan_with_graphs(shape, loss_chunk_tokens=None, **batches)
    if not batches.get("fused_ce"):
        return plain
    tokens = AUTO_LOSS_CHUNK_TOKENS
    try:
        chunked = _plan_with_graphs(shape, loss_chunk_tokens=tokens, **batches)
    except ValueError:
        chunked = None
    kept = ("micro_batch_tokens", "micro_batch_rows", "gradient_accumulation_steps", "gradient_checkpointing",
            "dequantize_base", "cuda_graphs")
    if chunked is None or any(getattr(chunked, k) != getattr(plain, k) for k in kept) or (
            chunked.budget_gib is not None and chunked.predicted_peak_gib > chunked.budget_gib):
        plain.reasons.append(f"Liger's own loss chunks (train.loss_chunk_tokens=auto): the logits of chunks of "
                             f"{tokens} tokens ({largest_chunk(tokens) * shape.vocab * 2 / GIB:.2f} GiB) would "
                             f"change the plan")
        return plain
    chunked.reasons.append(f"Liger's loss in chunks of at least {tokens} tokens (train.loss_chunk_tokens=auto): "
                           f"fewer passes over the lm_head weight")
    return chunked.model_copy(update={"loss_chunk_tokens": tokens})


def _plan_with_graphs(shape: ModelShape, *, cuda_graphs: bool | str = False, ranks: int = 1,
                      **batches) -> TrainingPlan:
    """The plan of plan_batches (its keywords: `batches`) with CUDA graphs where asked for (`cuda_graphs`) and
    possible: on one GPU or several under DDP (`ranks` in all), the layers compiled (a checkpoint then recomputes
    inside each layer's graph: training/compiling.py) and the rows packed. `true` plans the micro-batches around the
    graphs' pool (GRAPH_POOL). `auto` holds graphs only where they were measured to pay: it adds them to the plan
    where it leaves room for their pool, and otherwise (a memory budget) takes the plan around the pool if its
    micro-batches keep at least GRAPHS_MIN_SHARE of the tokens, the same base and the same checkpointing."""
    batches = {**batches, "ranks": ranks}  # for the plan's wording: its token figures are per rank
    plan = plan_batches(shape, **batches)
    if cuda_graphs is False:
        return plan
    why_not = ("no GPU" if batches.get("free_mib") is None else
               "FSDP shards the layers" if batches.get("shards", 1) > 1 else
               "the decoder layers are not compiled" if not plan.compile_layers else
               "the rows are not packed" if not plan.packing else None)
    pooled = False  # the plan's micro-batches already planned around the graphs' pool
    if why_not is None and cuda_graphs == "auto":
        room = (plan.budget_gib - plan.predicted_peak_gib) * GIB
        why_not = (f"{ranks} ranks (measured on one)" if ranks > 1 else
                   "the layers compile mid-run (train.compile=auto; true compiles them before the first step)"
                   if plan.compile_deferred else
                   "the base stays 4-bit (measured over the dequantized base)"
                   if batches.get("four_bit") and not plan.dequantize_base else
                   None)
        if why_not is None and room < GRAPH_POOL:
            around, why_not = _planned_around_the_pool(shape, plan, room, batches)
            if around is not None:
                plan, pooled = around, True
    if why_not:
        plan.reasons.append(f"CUDA graphs off (train.cuda_graphs={str(cuda_graphs).lower()}): {why_not}")
        return plan
    if cuda_graphs is True:  # the micro-batches planned around the graphs' pool
        plan = plan_batches(shape, graphs=True, **batches)
        pooled = True
    if pooled:
        peak = plan.predicted_peak_gib
    else:
        peak = round(plan.predicted_peak_gib + GRAPH_POOL / GIB, 2)
    plan.reasons.append(f"CUDA graphs: each compiled layer's passes replayed, every micro-batch padded to "
                        f"{plan.micro_batch_tokens} tokens ({GRAPH_POOL / GIB:.0f} GiB planned for their pool)")
    return plan.model_copy(update={"cuda_graphs": True, "predicted_peak_gib": peak})


GRAPHS_MIN_SHARE = 0.5
"""The least share of its micro-batch tokens a plan keeps when `auto` re-plans it around the graphs' pool: the
shares at which graphs were measured to pay within a budget (docs/gpus.md, CUDA graphs)."""


def _planned_around_the_pool(shape: ModelShape, plan: TrainingPlan, room: float,
                             batches: dict) -> tuple[TrainingPlan | None, str | None]:
    """The plan of `batches` with the graphs' pool counted, where `plan` (without it) leaves only `room` bytes for
    the pool, and it keeps what `auto` measured graphs with; else (None, why not)."""
    left = f"the plan leaves {room / GIB:.1f} GiB, less than their pool ({GRAPH_POOL / GIB:.0f} GiB)"
    try:
        around = plan_batches(shape, graphs=True, **batches)
    except ValueError:
        return None, f"{left}, and no micro-batch fits beside it"
    tokens, before = around.micro_batch_tokens, plan.micro_batch_tokens
    if around.dequantize_base != plan.dequantize_base:
        return None, f"{left}, and a plan around it would keep the base 4-bit"
    if around.gradient_checkpointing != plan.gradient_checkpointing:
        return None, f"{left}, and a plan around it would turn activation checkpointing on"
    if around.budget_gib is not None and around.predicted_peak_gib > around.budget_gib:
        return None, f"{left}, and it does not fit beside micro-batches of {tokens} tokens (train.micro_batch_tokens)"
    if tokens is None or before is None or tokens < GRAPHS_MIN_SHARE * before:
        return None, (f"{left}, and around it the micro-batches would hold {tokens} tokens against {before} "
                      f"(under {GRAPHS_MIN_SHARE:.0%})")
    around.reasons.append(f"{left}: micro-batches of {tokens} tokens with graphs rather than {before} without "
                          f"(train.cuda_graphs=auto)")
    return around, None


FP8_CAPABILITY = (8, 9)  # the first NVIDIA GPUs with FP8 tensor cores (Ada; Hopper is 9.0)


def with_fp8_base(plan: TrainingPlan, asked: bool, capabilities: list[tuple[int, int]],
                  compute_dtype: str = "bfloat16") -> TrainingPlan:
    """`plan` with the dequantized base's matmuls in FP8 where asked for (train.fp8_base) and possible: the base held
    dequantized (so not under FSDP), and FP8 tensor cores on every selected GPU (`capabilities`; none: the CPU, where
    it runs for tests) computing in bf16 (their row-wise scaled FP8 matmuls give bf16 only). The memory plan holds: two
    FP8 copies of each weight take the bytes of one bf16 copy. On a GPU it also needs the decoder layers compiled: run
    eagerly, each quantization of an activation or gradient is a chain of separate kernels, which cost more than the
    FP8 matmuls save (benchmarks/results/train-bench-1xGPU-20261205-102422/NOTE.md)."""
    if not asked:
        return plan
    old = next((c for c in capabilities if tuple(c) < FP8_CAPABILITY), None)
    why_not = ("the base stays 4-bit (FP8 is made from the dequantized base)" if not plan.dequantize_base else
               f"a GPU of compute capability {old[0]}.{old[1]} has no FP8 tensor cores (8.9+)" if old else
               f"the compute dtype is {compute_dtype} (a GPU's row-wise scaled FP8 matmul gives bfloat16 only)"
               if capabilities and compute_dtype != "bfloat16" else
               "the decoder layers are not compiled (train.compile): eager, each activation's quantization is a chain "
               "of separate kernels that cost more than the FP8 matmuls save" if capabilities and not
               plan.compile_layers else None)
    if why_not:
        plan.reasons.append(f"FP8 base off (train.fp8_base=true): {why_not}")
        return plan
    plan.reasons.append("the frozen base's matmuls in FP8 (e4m3 weights and activations, scaled per row and token; "
                        "train.fp8_base=true)")
    return plan.model_copy(update={"fp8_base": True})


def plan_batches(shape: ModelShape, *, free_mib: int | None, max_row: int, mean_row: float,
                 rows_per_step: int, packing: bool, micro_batch_tokens: int | None, checkpointing: bool | str,
                 four_bit: bool, lora_r: int, lora_targets: list[str] | str, fused_ce: bool,
                 dtype_bytes: int = 2, upcast: bool = True, per_device_rows: int = 8,
                 accumulation: int = 1, dequantize: bool = False,
                 compile_layers: bool = False, compile_deferred: bool = False, shards: int = 1,
                 budget_gib: float | None = None, graphs: bool = False,
                 loss_chunk_tokens: int | None = None, ranks: int = 1) -> TrainingPlan:
    """Choose micro-batch size, accumulation, checkpointing and whether to hold the base dequantized (asked for by
    `dequantize`). `free_mib` is the least free memory of the selected GPUs (None on the CPU), `budget_gib`
    `hardware.memory_budget_gib` (planning_bytes: what the plan may use of them). `compile_deferred` compiles the
    layers only once the first steps show the run repays it; over a base kept 4-bit, see _compiled_over_4bit.

    The dequantized base gets its own micro-batches (its bf16 weights leave less room for them), with the
    checkpointing the 4-bit base needs (`auto`), and is held wherever they fit: at equal checkpointing, dropping the
    per-call dequantization and compiling the layers are faster (benchmarks/README.md), while turning
    checkpointing on to make room for the bf16 weights runs the forward pass a second time."""
    batches = dict(max_row=max_row, mean_row=mean_row, rows_per_step=rows_per_step, packing=packing,
                   micro_batch_tokens=micro_batch_tokens, lora_r=lora_r, lora_targets=lora_targets,
                   fused_ce=fused_ce, dtype_bytes=dtype_bytes, upcast=upcast, per_device_rows=per_device_rows,
                   accumulation=accumulation, shards=shards, budget_gib=budget_gib, graphs=graphs,
                   loss_chunk_tokens=loss_chunk_tokens, ranks=ranks)
    plan = _plan_batches(shape, free_mib=free_mib, four_bit=four_bit, checkpointing=checkpointing, **batches)
    if not four_bit:
        return plan.model_copy(update={"compile_layers": compile_layers,
                                       "compile_deferred": compile_layers and compile_deferred})
    if not dequantize:
        return _compiled_over_4bit(plan, compile_layers, compile_deferred, shards)
    ckpt = plan.gradient_checkpointing
    auto = checkpointing == "auto"
    try:
        held = _plan_batches(shape, free_mib=free_mib, four_bit=False, checkpointing=ckpt if auto else checkpointing,
                             ckpt_why="auto: decided for the 4-bit base" if auto else "train.gradient_checkpointing",
                             **batches)
        fits = held.budget_gib is None or held.predicted_peak_gib <= held.budget_gib
    except ValueError:  # not even a micro-batch holding the longest row fits beside the dequantized weights
        held, fits = None, False
    if not fits:
        tokens = plan.micro_batch_tokens or plan.micro_batch_rows * max_row
        peak = peak_bytes(shape, tokens, checkpointing=ckpt, four_bit=False, lora_r=lora_r, lora_targets=lora_targets,
                          fused_ce=fused_ce, dtype_bytes=dtype_bytes, upcast=upcast, shards=shards, graphs=graphs,
                          loss_chunk_tokens=loss_chunk_tokens)
        plan.reasons.append(f"NF4 base kept 4-bit: dequantized it would need {peak / GIB:.1f} GiB at this micro-batch, "
                            f"and no micro-batch {'with' if ckpt else 'without'} activation checkpointing that holds "
                            f"the longest row fits beside the dequantized weights"
                            + (f" in {plan.budget_gib:.1f} GiB" if plan.budget_gib is not None else ""))
        return _compiled_over_4bit(plan, compile_layers, compile_deferred, shards)
    held.reasons.append("NF4 base held dequantized in the compute dtype: the same weights every 4-bit matmul "
                        "multiplies by, without dequantizing them again on every call"
                        + (f" ({held.predicted_peak_gib:.1f} GiB predicted)" if held.budget_gib is not None else ""))
    if compile_layers:
        held.reasons.append("decoder layers compiled (torch.compile, dynamic shapes)" + (
            " once the first steps' measured time shows the rest of the run repays the compilation "
            "(train.compile=auto; true compiles before the first step)" if compile_deferred else ""))
    return held.model_copy(update={"dequantize_base": True, "compile_layers": compile_layers,
                                   "compile_deferred": compile_layers and compile_deferred})


def _compiled_over_4bit(plan: TrainingPlan, compile_layers: bool, compile_deferred: bool,
                        shards: int) -> TrainingPlan:
    """Compiled layers over a base that stays 4-bit: only with train.compile=true (not `auto`, whose decision counts
    on the speed-up measured over the dequantized base) and not under FSDP. Each 4-bit layer's dequantize and matmul
    (bitsandbytes' own ops) trace into the layer's graph, whose backward pass dequantizes again rather than keeping
    the dequantized weights, as the eager layer does."""
    if not compile_layers:
        return plan
    why_not = ("FSDP shards the 4-bit base" if shards > 1 else
               "train.compile=auto leaves the 4-bit layers eager (true compiles them)" if compile_deferred else None)
    if why_not:
        plan.reasons.append(f"decoder layers not compiled: {why_not}")
        return plan.model_copy(update={"compile_layers": False, "compile_deferred": False})
    plan.reasons.append("decoder layers compiled through the 4-bit matmuls (train.compile=true; the backward pass "
                        "dequantizes each weight again)")
    return plan.model_copy(update={"compile_layers": True, "compile_deferred": False})


def _plan_batches(shape: ModelShape, *, free_mib: int | None, max_row: int, mean_row: float,
                  rows_per_step: int, packing: bool, micro_batch_tokens: int | None, checkpointing: bool | str,
                  four_bit: bool, lora_r: int, lora_targets: list[str] | str, fused_ce: bool,
                  dtype_bytes: int, upcast: bool, per_device_rows: int, accumulation: int,
                  shards: int, budget_gib: float | None, graphs: bool, loss_chunk_tokens: int | None,
                  ranks: int = 1, ckpt_why: str = "train.gradient_checkpointing") -> TrainingPlan:
    reasons: list[str] = []
    target = rows_per_step * mean_row
    common = dict(four_bit=four_bit, lora_r=lora_r, lora_targets=lora_targets, fused_ce=fused_ce,
                  dtype_bytes=dtype_bytes, upcast=upcast, shards=shards, graphs=graphs and free_mib is not None,
                  loss_chunk_tokens=loss_chunk_tokens)
    budget, share = planning_bytes(free_mib, budget_gib)

    def fits(tokens: int, ckpt: bool) -> bool:
        return budget is None or peak_bytes(shape, tokens, checkpointing=ckpt, **common) <= budget

    def largest(ckpt: bool) -> int:
        if budget is None:
            return MAX_MICRO_BATCH_TOKENS
        fixed = peak_bytes(shape, 0, checkpointing=ckpt, **common)
        per = (peak_bytes(shape, 1, checkpointing=ckpt, **common) - fixed)
        return max(0, min(MAX_MICRO_BATCH_TOKENS, int((budget - fixed) / per)))

    if not packing:
        padded = per_device_rows * max_row
        if checkpointing == "auto":
            ckpt = not fits(padded, False)
            reasons.append(f"activation checkpointing on: without it a padded batch of {padded} tokens does not fit"
                           if ckpt else f"no activation checkpointing: a padded batch of {padded} tokens fits without "
                           "it")
        else:
            ckpt = bool(checkpointing)
            reasons.append(f"activation checkpointing {'on' if ckpt else 'off'} ({ckpt_why})")
        peak = peak_bytes(shape, padded, checkpointing=ckpt, **common)
        reasons.append(f"padded batches of {per_device_rows} rows as configured (train.packing=false)")
        return TrainingPlan(packing=False, micro_batch_tokens=0, micro_batch_rows=per_device_rows,
                            gradient_accumulation_steps=accumulation, gradient_checkpointing=ckpt,
                            tokens_per_step=target, predicted_peak_gib=round(peak / GIB, 2),
                            budget_gib=None if budget is None else round(budget / GIB, 2), reasons=reasons)

    if checkpointing == "auto":
        wanted = max(max_row, min(math.ceil(target), USEFUL_TOKENS))
        ckpt = largest(False) < wanted
        reasons.append("activation checkpointing on: without it a micro-batch of "
                       f"{wanted} tokens does not fit" if ckpt else
                       f"no activation checkpointing: up to {largest(False)} tokens fit without it")
    else:
        ckpt = bool(checkpointing)
        reasons.append(f"activation checkpointing {'on' if ckpt else 'off'} ({ckpt_why})")

    if micro_batch_tokens:
        cap = micro_batch_tokens
        reasons.append(f"micro-batch of {cap} tokens (train.micro_batch_tokens)")
    else:
        cap = largest(ckpt)
        reasons.append(f"at most {cap} tokens fit in a micro-batch"
                       + (f" ({budget / GIB:.1f} GiB = {share})" if budget else ""))
    if cap < max_row and micro_batch_tokens:
        raise ValueError(f"the longest row ({max_row} tokens) does not fit in one micro-batch of "
                         f"train.micro_batch_tokens={cap}: set at least {max_row}, or lower data.max_length")
    if cap < max_row:
        raise ValueError(f"the longest row ({max_row} tokens) does not fit in one micro-batch ({cap} tokens "
                         "at most): lower data.max_length, turn on train.gradient_checkpointing, or use more memory")
    steps_needed = max(1, math.ceil(target / cap))
    tokens = max(max_row, math.ceil(target / steps_needed))
    if not micro_batch_tokens:
        # rows_per_step and the micro-batches are each rank's; the optimizer step takes every rank's tokens
        per_step = ("tokens per optimizer step" if ranks == 1 else
                    f"tokens per rank per optimizer step ({target * ranks:.0f} over {ranks} ranks)")
        reasons.append(f"{rows_per_step} rows x {mean_row:.0f} mean tokens = {target:.0f} {per_step} "
                       f"-> {steps_needed} micro-batch(es) of <= {tokens} tokens")
    else:
        tokens = cap
        steps_needed = max(1, math.ceil(target / cap))
    peak = peak_bytes(shape, tokens, checkpointing=ckpt, **common)
    if budget is not None and not fits(tokens, ckpt):
        reasons.append("warning: the predicted peak exceeds the budget; an out-of-memory retry halves the "
                       "micro-batch")
    return TrainingPlan(packing=True, micro_batch_tokens=tokens, micro_batch_rows=0,
                        gradient_accumulation_steps=steps_needed, gradient_checkpointing=ckpt, tokens_per_step=target,
                        predicted_peak_gib=round(peak / GIB, 2),
                        budget_gib=None if budget is None else round(budget / GIB, 2), reasons=reasons)
