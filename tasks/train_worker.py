"""Training rank body: `torchrun ... -m tasks.train_worker job.json`, one process per rank.

Each rank loads the 4-bit checkpoint onto its own device and trains the LoRA adapter with the transformers
Trainer; rank 0 writes the adapter and `train_metrics.json`. The orchestrator side is `tasks/train.py`.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from pathlib import Path
from typing import Any

from tasks.config import FinetuneConfig
from tasks.dataset import IGNORE_INDEX, load_split
from tasks.environment import Plan
from tasks.launcher import emit_event, worker_main
from tasks.quantize import torch_dtype

class PadCollator:
    """Right-pad a batch; padding never counts in the loss. Counts the real tokens it has seen."""

    def __init__(self, pad_token_id: int):
        self.pad = pad_token_id
        self.tokens = 0

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            mask[i, :n] = 1
        self.tokens += int(mask.sum())
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _callback(max_steps_hint: int, collator: PadCollator, started: float):
    from transformers import TrainerCallback

    class ProgressEvents(TrainerCallback):
        """Rank 0 reports progress as events; the task turns them into logs and a Prefect progress artifact."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                elapsed = time.perf_counter() - started
                emit_event("train_log", step=state.global_step, max_steps=state.max_steps or max_steps_hint,
                           loss=round(float(logs["loss"]), 5), learning_rate=logs.get("learning_rate"),
                           tokens_per_second=round(collator.tokens * args.world_size / max(elapsed, 1e-9), 1),
                           elapsed=round(elapsed, 1))

        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                emit_event("checkpoint", step=state.global_step)

    return ProgressEvents()


def last_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest *complete* checkpoint. A crash during a save leaves a directory without trainer_state.json
    (the Trainer writes it last); such leftovers are removed so the Trainer can write that step again."""
    if not ckpt_dir.is_dir():
        return None
    candidates = sorted((p for p in ckpt_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                        key=lambda p: int(p.name.split("-")[-1]), reverse=True)
    for path in candidates:
        try:
            json.loads((path / "trainer_state.json").read_text())
            return path
        except (OSError, json.JSONDecodeError):
            print(f"removing incomplete checkpoint {path.name} (interrupted while saving)", flush=True)
            shutil.rmtree(path, ignore_errors=True)
    return None


def _train(job: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    cfg = FinetuneConfig.model_validate(job["config"])
    plan = Plan.model_validate(job["plan"])
    t = cfg.train
    out = Path(job["out"])
    base_path, data_path = Path(job["base"]), Path(job["data"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    rank = int(os.environ.get("RANK", 0))
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    (out / "ranks" / f"rank-{rank}.pid").write_text(str(os.getpid()))  # lets an operator (or a test) find a rank
    on_gpu = plan.device == "cuda" and torch.cuda.is_available()
    if plan.device == "cuda" and not on_gpu:
        raise RuntimeError("the plan selects GPUs but this worker sees no CUDA device")
    if on_gpu:
        torch.cuda.set_device(local_rank)
    device_map = {"": local_rank} if on_gpu else {"": "cpu"}

    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(
        base_path, device_map=device_map, dtype=torch_dtype(plan.compute_dtype), attn_implementation=plan.train_attn,
    )
    if job["load_in_4bit"]:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=t.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    elif t.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM",
    ))
    model.config.use_cache = False

    train_ds = load_split(data_path, "train")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collator = PadCollator(pad_id)
    args = TrainingArguments(
        output_dir=str(out / "checkpoints"), max_steps=t.max_steps, num_train_epochs=t.epochs,
        per_device_train_batch_size=t.per_device_batch_size, gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate, lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, optim=t.optimizer,
        bf16=plan.precision == "bf16", fp16=plan.precision == "fp16", use_cpu=not on_gpu,
        ddp_backend="nccl" if on_gpu else "gloo", ddp_find_unused_parameters=False,
        logging_steps=t.logging_steps, logging_first_step=True, save_strategy="steps", save_steps=t.save_steps,
        save_total_limit=t.save_total_limit, seed=t.seed, data_seed=t.seed, report_to=[],
        remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False,
    )
    resume = last_checkpoint(out / "checkpoints")
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, data_collator=collator)
    started = time.perf_counter()
    trainer.add_callback(_callback(t.max_steps, collator, started))
    if resume is not None and trainer.is_world_process_zero():
        print(f"resuming from {resume.name} (optimizer, scheduler and RNG state restored)", flush=True)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    seconds = time.perf_counter() - started

    if on_gpu:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    stats = torch.tensor([float(collator.tokens), peak], dtype=torch.float64,
                         device=f"cuda:{local_rank}" if on_gpu else "cpu")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if dist.is_available() and dist.is_initialized():
        tokens = stats[:1].clone()
        dist.all_reduce(tokens, op=dist.ReduceOp.SUM)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        stats[0] = tokens[0]
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    (out / "ranks" / f"rank-{rank}.json").write_text(json.dumps({
        "rank": rank, "world_size": world, "global_step": trainer.state.global_step, "backend": backend,
        "device": str(next(model.parameters()).device),
        "device_name": torch.cuda.get_device_name() if on_gpu else "cpu",
        "tokens": collator.tokens,
    }))
    if backend is not None:
        dist.barrier()  # every rank's record is on disk before rank 0 reads them
    if not trainer.is_world_process_zero():
        return None
    ranks = [json.loads((out / "ranks" / f"rank-{r}.json").read_text()) for r in range(world)]

    adapter = out / "adapter"
    if adapter.exists():
        shutil.rmtree(adapter)
    model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    curve = [(int(e["step"]), float(e["loss"])) for e in trainer.state.log_history if "loss" in e]
    total_tokens = int(stats[0])
    result = dict(
        adapter_path=str(adapter), output_dir=str(out), fingerprint=job["fingerprint"],
        steps=trainer.state.global_step, world_size=world, device=plan.device, loss_curve=curve,
        first_loss=curve[0][1], final_loss=curve[-1][1], tokens_per_second=round(total_tokens / seconds, 1),
        train_tokens=total_tokens, train_seconds=round(seconds, 2), peak_memory_mb=round(float(stats[1]), 1),
        resumed_from_step=int(resume.name.split("-")[-1]) if resume else None,
        backend=backend, rank_steps=[r["global_step"] for r in ranks], devices=[r["device_name"] for r in ranks],
    )
    (out / "train_metrics.json").write_text(json.dumps(result, indent=2))
    print(f"trained {result['steps']} steps on {world} {plan.device} rank(s): loss {result['first_loss']:.4f} -> "
          f"{result['final_loss']:.4f}, {result['tokens_per_second']} tokens/s, peak {result['peak_memory_mb']} MiB",
          flush=True)
    return result


if __name__ == "__main__":
    worker_main(_train)
