"""The peers of `make bench-train`: the tools a user who wants fast QLoRA picks instead of this project.

    python benchmarks/peer_recipe.py job.json      (benchmarks/train_speed.py writes the job and runs this)

Each runs in a process of its own, with the peers' own site on PYTHONPATH (Unsloth pins transformers <= 5.17):

- `unsloth`: `FastLanguageModel.from_pretrained(<the local checkpoint>, load_in_4bit=True)`, `get_peft_model` with
  LoRA r=16 alpha=32 on the 7 projections and `use_gradient_checkpointing="unsloth"`, Unsloth's defaults otherwise
  (LoRA dropout 0, its own padding-free choice), TRL's `SFTTrainer` as Unsloth patches it;
- `trl`: TRL's `SFTTrainer` loading the checkpoint itself with bitsandbytes NF4 (double quantization, bf16 compute),
  `padding_free=True`, `use_liger_kernel=True`, PEFT LoRA r=16 alpha=32 dropout 0 on the 7 projections;
- `trl-padded`: the same as `trl` with TRL's default batches (`padding_free=False`: each batch padded to its longest
  row). TRL says padding-free works reliably only with flash-attention, which the sdpa runs here lack: this row is
  the user who keeps TRL's default;
- `trl-bf16`: the same as `trl` on the bf16 base.

TRL's gradient checkpointing (its default) is on under a memory budget and off without one (the faster choice where
memory allows). Every peer trains the bench's rows with the same effective batch (8 rows x the accumulation), steps,
learning rate, cosine schedule, warm-up, optimizer (adamw_torch) and step clock as the seed recipe; a memory budget is
`torch.cuda.set_per_process_memory_fraction`, so a peer that needs more fails as on a smaller GPU. The job's
`rows_per_micro_batch` (8 unless `--peer-rows` says otherwise) splits that batch into micro-steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PEERS = ("unsloth", "trl", "trl-padded", "trl-bf16")


def first_imports(job_path: str) -> dict:
    """The job, offline, and Unsloth's import before transformers': Unsloth patches transformers as it is imported, and
    fully only when it comes first ("Unsloth should be imported before [transformers] to ensure all optimizations are
    applied"); the project's modules imported below import transformers."""
    job = json.loads(Path(job_path).read_text())
    if job.get("peer") not in PEERS:
        raise SystemExit(f"unknown peer {job.get('peer')!r}: one of {', '.join(PEERS)}")
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS"):
        os.environ.setdefault(key, "1")
    if job["peer"] == "unsloth":
        import unsloth  # noqa: F401
    return job


if __name__ == "__main__":
    first_imports(sys.argv[1])

from benchmarks.seed_recipe import budget, train_timed  # noqa: E402  (capped, timed and reported as the seed is)
from finetune_flows.data.dataset import load_split  # noqa: E402
from finetune_flows.files import write_json  # noqa: E402
from finetune_flows.packages import installed_version  # noqa: E402
from finetune_flows.data.packing import TokenTally  # noqa: E402
from finetune_flows.training.clock import StepClock, device_events  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class TokenCounter(TokenTally):
    """Wraps a peer's own collator: the real tokens of the rows it batches (padding-free or not) count when the model
    runs the batch, as the seed's and ours do (TokenTally)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __call__(self, rows):
        self.built(sum(len(r["input_ids"]) for r in rows))
        return self.inner(rows)


def clocked(trainer, events=None) -> tuple[TokenCounter, StepClock]:
    """The bench's step clock and token count on a peer's trainer (`events`: clock.device_events() on a GPU)."""
    counter = TokenCounter(trainer.data_collator)
    trainer.data_collator = counter
    clock = StepClock(counter, trainer.model, events)
    trainer.add_callback(clock.callback())
    return counter, clock


def versions() -> dict[str, str | None]:
    return {d: installed_version(d) for d in ("unsloth", "unsloth_zoo", "trl", "transformers", "peft", "bitsandbytes",
                                               "liger-kernel", "datasets", "torch")}


def sft_config(job: dict, on_gpu: bool, **extra):
    from trl import SFTConfig

    return SFTConfig(
        output_dir=str(Path(job["out"]) / "checkpoints"),
        per_device_train_batch_size=job.get("rows_per_micro_batch", 8),
        gradient_accumulation_steps=job["gradient_accumulation_steps"], max_steps=job["steps"],
        learning_rate=job["learning_rate"], lr_scheduler_type="cosine", warmup_steps=job["warmup_steps"],
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, bf16=on_gpu, use_cpu=not on_gpu,
        logging_steps=5, save_strategy="no", report_to=[], disable_tqdm=True, seed=job["seed"], max_length=None,
        dataset_num_proc=None, **extra)


def build_unsloth(job: dict, rows):
    import unsloth  # noqa: F401  (first: it patches transformers and TRL)
    from unsloth import FastLanguageModel
    from trl import SFTTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(model_name=job["model"], max_seq_length=job["max_length"],
                                                         load_in_4bit=True, dtype=None)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, target_modules=PROJECTIONS,
                                             use_gradient_checkpointing="unsloth", random_state=job["seed"])
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=rows,
                         args=sft_config(job, True))
    return trainer, (f"Unsloth {unsloth.__version__}: NF4 base, LoRA dropout 0, gradient checkpointing 'unsloth', "
                     f"padding-free {bool(getattr(trainer.args, 'padding_free', False))}")


def trl_settings(peer: str, job: dict, on_gpu: bool) -> dict:
    """What a TRL row sets beyond sft_config: the base (NF4, or bf16 for `trl-bf16`), padding-free batches (not for
    `trl-padded`), Liger (Triton kernels: CUDA only) and gradient checkpointing (TRL's default, kept under a memory
    budget; off without one, the faster choice where memory allows)."""
    return {"bf16_base": peer == "trl-bf16", "padding_free": peer != "trl-padded", "use_liger_kernel": on_gpu,
            "gradient_checkpointing": bool(job.get("memory_budget_gib"))}


def build_trl(job: dict, rows, on_gpu: bool):
    import torch
    import trl
    from peft import LoraConfig
    from transformers import AutoTokenizer, BitsAndBytesConfig
    from trl import SFTTrainer

    settings = trl_settings(job["peer"], job, on_gpu)
    bf16_base = settings.pop("bf16_base")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    quant = None if bf16_base else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)
    args = sft_config(job, on_gpu, **settings, model_init_kwargs={
        "dtype": dtype, "attn_implementation": "sdpa", "device_map": {"": 0 if on_gpu else "cpu"}})
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=job["model"], args=args, train_dataset=rows,
                         processing_class=AutoTokenizer.from_pretrained(job["model"]), quantization_config=quant,
                         peft_config=lora)
    return trainer, (f"TRL {trl.__version__} SFTTrainer: {'bf16' if bf16_base else 'NF4'} base, "
                     f"{'padding-free' if args.padding_free else 'padded'} batches, "
                     f"Liger {'on' if args.use_liger_kernel else 'off (CPU)'}, "
                     f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}, LoRA dropout 0, sdpa")


def main(job_path: str) -> None:
    job = first_imports(job_path)  # run as a script, it has already run before the imports above
    peer = job["peer"]
    import torch
    from datasets import Dataset

    out = Path(job["out"])
    on_gpu = torch.cuda.is_available()
    budget(job)
    rows = Dataset.from_list(load_split(Path(job["data"]), "train"))
    if peer == "unsloth":
        trainer, layout = build_unsloth(job, rows)
    else:
        trainer, layout = build_trl(job, rows, on_gpu)
    counter, clock = clocked(trainer, device_events() if on_gpu else None)
    result = {
        "versions": versions(), **train_timed(trainer, counter, clock, job["warmup"], out),
        "layout": f"{layout}; batches of {job.get('rows_per_micro_batch', 8)} rows x "
                  f"{job['gradient_accumulation_steps']} accumulation",
    }
    write_json(out / "result.json", result)


if __name__ == "__main__":
    main(sys.argv[1])
