"""The seed recipe, as the Transformers NVIDIA-GPU guide gives it: the baseline of `make bench-train`.

    python benchmarks/seed_recipe.py job.json      (benchmarks/train_speed.py writes the job and runs this)

bitsandbytes NF4 with double quantization and bf16 compute, `prepare_model_for_kbit_training` with gradient
checkpointing, PEFT LoRA r=16 alpha=32 dropout=0.05 on all 7 linear projections, padded micro-batches of 8 rows,
sdpa attention, the Trainer. Timed with the same step clock as the project's own path
(finetune_flows/training/worker.py). Under a memory budget (the job's `memory_budget_gib`) its allocator is capped
there, as the peers' are (`budget`), so a recipe that needs more fails as on a smaller GPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from finetune_flows.data.dataset import load_split  # noqa: E402
from finetune_flows.files import write_json  # noqa: E402
from finetune_flows.data.packing import PadCollator  # noqa: E402
from finetune_flows.training.clock import StepClock, device_events, steady_state  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def budget(job: dict) -> None:
    """The row's memory budget: the allocator capped at `memory_budget_gib` GiB of the device (the seed's and the
    peers' rows; ours plans within it through hardware.memory_budget_gib)."""
    import torch

    gib = job.get("memory_budget_gib")
    if gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), 0)


def main(job_path: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments, set_seed

    job = json.loads(Path(job_path).read_text())
    out = Path(job["out"])
    on_gpu = torch.cuda.is_available()
    dtype = torch.bfloat16 if on_gpu else torch.float32
    budget(job)  # before anything is allocated
    set_seed(job["seed"])
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(job["model"], quantization_config=quant, dtype=dtype,
                                                 device_map={"": 0 if on_gpu else "cpu"}, attn_implementation="sdpa")
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=PROJECTIONS,
                                             task_type="CAUSAL_LM"))
    rows = load_split(Path(job["data"]), "train")
    collator = PadCollator(job["pad_token_id"])
    args = TrainingArguments(
        output_dir=str(out / "checkpoints"), per_device_train_batch_size=8,
        gradient_accumulation_steps=job["gradient_accumulation_steps"], max_steps=job["steps"],
        learning_rate=job["learning_rate"], lr_scheduler_type="cosine", warmup_steps=job["warmup_steps"],
        bf16=on_gpu, use_cpu=not on_gpu, gradient_checkpointing=True, logging_steps=5, save_strategy="no",
        report_to=[], remove_unused_columns=False, disable_tqdm=True, seed=job["seed"], optim="adamw_torch",
    )
    clock = StepClock(collator, model, device_events() if on_gpu else None)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator, callbacks=[clock.callback()])
    result = {
        **train_timed(trainer, collator, clock, job["warmup"], out),
        "layout": f"padded batches of 8 rows x {job['gradient_accumulation_steps']} accumulation, sdpa, "
                  "gradient checkpointing, fp32 upcast, LoRA dropout 0.05",
    }
    write_json(out / "result.json", result)


def train_timed(trainer, tally, clock: StepClock, warmup: int, out: Path) -> dict:
    """Train, save the adapter under `out`, and return what every recipe's row reports (the peers' too): the real
    tokens `tally` counted, per second over the run and in steady state, each step's seconds, peak memory reserved
    and allocated, the loss curve."""
    import torch

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    clock.settle()
    seconds = time.perf_counter() - started
    if tally.tokens == 0:
        raise RuntimeError("no batch was counted (the clock's hook on the model never ran): no figure")
    trainer.model.save_pretrained(out / "adapter")
    return {
        "steps": trainer.state.global_step, "train_tokens": tally.tokens, "train_seconds": round(seconds, 2),
        "tokens_per_second": round(tally.tokens / seconds, 1),
        "steady_state": steady_state(clock.steps, 1.0, warmup),
        "step_seconds": [round(sec, 4) for _, sec, _, _ in clock.steps],  # each step's, as ours' rows keep them
        "peak_memory_mb": round(torch.cuda.max_memory_reserved() / 2**20, 1) if on_gpu else None,
        "peak_allocated_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if on_gpu else None,
        "loss_curve": [(int(e["step"]), float(e["loss"])) for e in trainer.state.log_history if "loss" in e],
        "adapter_path": str(out / "adapter"),
    }


if __name__ == "__main__":
    main(sys.argv[1])
