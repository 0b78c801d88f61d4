"""Training rank body: `torchrun ... -m finetune_flows.training.worker job.json`, one process per rank.

Each rank loads the 4-bit checkpoint onto its own device and trains the LoRA adapter with the transformers Trainer.
By default batches are packed (data/packing.py: token-budget micro-batches, no padding, varlen attention from
models/attention.py) with the micro-batch size, accumulation and checkpointing the planner chose
(training/planner.py); Liger's fused kernels are switched on through the Trainer where installed. Rank 0 writes
the adapter and `train_metrics.json`. The orchestrator side is training/train.py.
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import time
from pathlib import Path

from finetune_flows.training.compiling import (
    compile_decoder_layers, compile_stats, compile_when_it_pays, cost_entry, describe_compile, layer_key,
    stable_gradients,
)
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.files import write_json
from finetune_flows.data.dataset import load_split
from finetune_flows.training.distributed import (
    barrier, checkpoint_step, gather, is_writer, prepare_ranks, single_rank_defaults,
)
from finetune_flows.config.plan import Plan
from finetune_flows.training.checkpoints import last_checkpoint, rotate_checkpoints, write_checkpoint_manifest
from finetune_flows.runtime.lifecycle import emit_event, worker_main
from finetune_flows.runtime.lifecycle import training_callback
from finetune_flows.models.quantize import torch_dtype
from finetune_flows.training import sharding
from finetune_flows.training.lean import lean_trainer, train_mode_once
from finetune_flows.training.loss_chunks import liger_chunks
from finetune_flows.models.dequantize import dequantize_model
from finetune_flows.models.float8 import float8_base
from finetune_flows.models.attention import packed_kernel_for, use_packed_attention
from finetune_flows.data.packing import FixedShape, PackedCollator, PackedDataset, PadCollator, build_schedule
from finetune_flows.training.clock import StepClock, device_events, steady_state, steady_text
from finetune_flows.runtime.gpus import cap_process_memory
from finetune_flows.training.planner import TrainingPlan
from finetune_flows.training.profiling import profiler_callback


def _callbacks(max_steps: int, collator, clock: StepClock, out: Path, started: float, keep: int | None = None):
    from transformers import TrainerCallback

    class Events(TrainerCallback):
        """Rank 0 reports progress as events; the task turns them into logs and a Prefect progress artifact."""

        def on_train_begin(self, args, state, control, **kwargs):
            clock.start()

        def _pace(self, args, state) -> dict:
            recent = clock.steps[-args.logging_steps:]
            seconds = sum(s for _, s, _, _ in recent)
            rate = sum(t for _, _, t, _ in recent) * args.world_size / seconds if seconds else None
            elapsed = time.perf_counter() - started
            total = state.max_steps or max_steps
            # none before a step has been timed (on a GPU a step's time is read once the device has run it)
            eta = (total - state.global_step) * seconds / len(recent) if recent else None
            return dict(step=state.global_step, max_steps=total,
                        tokens_per_second=None if rate is None else round(rate, 1),
                        elapsed=round(elapsed, 1), eta_seconds=None if eta is None else round(eta, 1))

        def on_step_end(self, args, state, control, **kwargs):
            clock.step_end(state.global_step)
            if state.is_world_process_zero:  # redraws the live progress line on a terminal
                emit_event("train_step", **self._pace(args, state))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                emit_event("train_log", loss=round(float(logs["loss"]), 5), learning_rate=logs.get("learning_rate"),
                           grad_norm=logs.get("grad_norm"), **self._pace(args, state))

        def on_save(self, args, state, control, **kwargs):
            clock.exclude()
            # Every rank writes its own rng_state_<rank>.pth after the shared files and nothing waits for it: the
            # manifest must list it at its final size, or the checkpoint reads as incomplete and is thrown away.
            # Ray's report of the checkpoint (ray_worker.py, a callback added after this one) relies on it too.
            barrier()
            if state.is_world_process_zero or (args.save_on_each_node and state.is_local_process_zero):
                ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
                if ckpt.is_dir():
                    write_checkpoint_manifest(ckpt)
                    if keep:  # only now: the Trainer's own rotation (off) ran before the manifest
                        rotate_checkpoints(ckpt.parent, keep)
            if state.is_world_process_zero:
                emit_event("checkpoint", step=state.global_step)

    return Events()


# ---------------------------------------------------------------- model


def build_model(cfg: FinetuneConfig, plan: Plan, tplan: TrainingPlan, base_path: Path, load_in_4bit: bool,
                device_map: dict, upcast: bool):
    """The 4-bit base with a fresh LoRA adapter, set up as the training plan says."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        base_path, device_map=device_map, dtype=torch_dtype(plan.compute_dtype), attn_implementation="sdpa",
        trust_remote_code=cfg.model.trust_remote_code,
    )
    ckpt_kwargs = {"use_reentrant": False}
    if load_in_4bit and tplan.dequantize_base:
        dequantize_model(model)  # in place, on the device: the weights the 4-bit matmuls multiply by
        load_in_4bit = False
    if load_in_4bit and upcast:
        # PEFT's recipe: frozen non-quantized weights (embeddings, norms, lm_head) in fp32
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=tplan.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=ckpt_kwargs)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        if tplan.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    model = get_peft_model(model, LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM",
    ))
    model.config.use_cache = False
    if tplan.fp8_base:
        print(f"FP8 base: {float8_base(model)} frozen linear layers in float8_e4m3fn", flush=True)
    if tplan.compile_layers and not tplan.compile_deferred:
        compile_decoder_layers(model, cuda_graphs=tplan.cuda_graphs)
    return model


def training_arguments(cfg: FinetuneConfig, plan: Plan, tplan: TrainingPlan, out: Path, batch_args: dict,
                       on_gpu: bool, use_liger: bool, **extra):
    """The Trainer's arguments for a rank: the config's train section, the plan, the batch layout (`batch_args`) and
    `extra` (FSDP's)."""
    from transformers import TrainingArguments

    t = cfg.train
    steps = batch_args["max_steps"]
    save_steps = min(t.save_steps, steps) if steps > 0 else t.save_steps  # a short run still leaves a checkpoint
    return TrainingArguments(
        output_dir=str(out / "checkpoints"), **batch_args,
        learning_rate=t.learning_rate, lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, optim=t.optimizer,
        bf16=plan.precision == "bf16", fp16=plan.precision == "fp16", use_cpu=not on_gpu,
        ddp_backend="nccl" if on_gpu else "gloo", ddp_find_unused_parameters=False,
        logging_steps=t.logging_steps, logging_first_step=True, save_strategy="steps", save_steps=save_steps,
        save_total_limit=None, seed=t.seed, data_seed=t.seed, report_to=cfg.tracking.report_to,
        remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False,
        # Each micro-batch's tensors go to the GPU from pinned memory without waiting: a blocking copy waits for the
        # stream to drain (the previous backward pass), then the GPU idles while the host collates the next batch
        # and launches the forward pass.
        accelerator_config={"non_blocking": on_gpu},
        # The filter tests every micro-batch's loss for NaN on the host, a device sync each time; a NaN loss is
        # logged as it is instead of hidden behind the running average.
        logging_nan_inf_filter=False,
        use_liger_kernel=use_liger,
        # compiled layers fuse norm, RoPE and SwiGLU themselves; Liger keeps the fused loss outside them
        liger_kernel_config={"rope": not tplan.compile_layers, "rms_norm": not tplan.compile_layers,
                             "swiglu": not tplan.compile_layers, "fused_linear_cross_entropy": True},
        **extra,
    )


def train_with_frozen_heap(trainer, resume: Path | None) -> None:
    """Train with what exists now frozen out of the cyclic collector: the model, the compiled graphs and the Trainer
    live for the whole run, and the collector's full passes would walk them every few steps."""
    gc.collect()
    gc.freeze()
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        gc.unfreeze()


# ---------------------------------------------------------------- the rank body


def use_device(plan: Plan, budget_gib: float | None, local_rank: int) -> bool:
    """Bind this rank to its GPU, capped at `hardware.memory_budget_gib` (runtime/gpus.py); False on the CPU."""
    import torch

    on_gpu = plan.device == "cuda" and torch.cuda.is_available()
    if plan.device == "cuda" and not on_gpu:
        raise RuntimeError("the plan selects GPUs but this worker sees no CUDA device")
    if on_gpu:
        torch.cuda.set_device(local_rank)
        cap_process_memory(budget_gib, local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls (upcast lm_head, loss) on tensor cores
    return on_gpu


def _train(job: dict) -> dict | None:
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer, PrinterCallback, Trainer, set_seed

    cfg = FinetuneConfig.model_validate(job["config"])
    plan = Plan.model_validate(job["plan"])
    tplan = plan.training
    if tplan is None:
        raise ValueError("the training job's plan has no training plan (the memory planner's choice)")
    split = int(job.get("micro_batch_split", 1))
    t = cfg.train
    out = Path(job["out"])
    base_path, data_path = Path(job["base"]), Path(job["data"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    on_gpu = use_device(plan, cfg.hardware.memory_budget_gib, local_rank)
    set_seed(t.seed)  # before the adapter's random init: a run is reproducible from its config
    upcast = plan.upcast_frozen
    model = build_model(cfg, plan, tplan, base_path, job["load_in_4bit"],
                        {"": local_rank} if on_gpu else {"": "cpu"}, upcast)
    use_liger = plan.liger and on_gpu

    tokenizer = AutoTokenizer.from_pretrained(base_path, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = load_split(data_path, "train")
    if tplan.packing:
        kernel = packed_kernel_for(plan.train_attn, on_gpu)
        use_packed_attention(model, kernel)
        lengths = [len(r["input_ids"]) for r in rows]
        schedule = build_schedule(lengths, tplan.micro_batch_tokens, tplan.gradient_accumulation_steps, world, t.seed,
                                  t.max_steps, t.epochs, split)
        fixed = (FixedShape.for_schedule(schedule, lengths, tplan.micro_batch_tokens // split)
                 if tplan.cuda_graphs else None)
        train_ds, collator = PackedDataset(rows, schedule), PackedCollator(pad_id, fixed)
        batch_args = dict(per_device_train_batch_size=1, gradient_accumulation_steps=schedule.accumulation,
                          max_steps=schedule.steps, train_sampling_strategy="sequential")
        layout = (f"packed micro-batches of <= {tplan.micro_batch_tokens // split} tokens x {schedule.accumulation} "
                  f"accumulation, {kernel} attention"
                  + (f", CUDA graphs (each padded to {fixed.tokens} tokens)" if fixed else ""))
    else:
        rows_per_micro = max(1, tplan.micro_batch_rows // split)
        train_ds, collator = rows, PadCollator(pad_id)
        batch_args = dict(per_device_train_batch_size=rows_per_micro,
                          gradient_accumulation_steps=tplan.gradient_accumulation_steps * split,
                          max_steps=t.max_steps, num_train_epochs=t.epochs)
        layout = f"padded batches of {rows_per_micro} rows x {batch_args['gradient_accumulation_steps']} accumulation"
    if use_liger and tplan.loss_chunk_tokens:
        liger_chunks(tplan.loss_chunk_tokens)
        layout += f", Liger's loss in chunks of >= {tplan.loss_chunk_tokens} tokens"
    steps = batch_args["max_steps"]
    fsdp = plan.strategy == "fsdp"
    args = training_arguments(cfg, plan, tplan, out, batch_args, on_gpu, use_liger,
                              **(sharding.trainer_kwargs(model) if fsdp else {}))
    last_checkpoint(out / "checkpoints")  # removes a checkpoint left half-written
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(out / "tensorboard"))  # copied into each run's directory
    trainer_class = lean_trainer(sharding.trainer_class(plan.compute_dtype) if fsdp else Trainer)
    train_mode_once(model)
    trainer = trainer_class(model=model, args=args, train_dataset=train_ds, data_collator=collator)
    trainer.remove_callback(PrinterCallback)  # progress goes out as events; its raw dicts would duplicate them
    trainer.add_callback(training_callback(job, trainer))  # stop on SIGTERM, progress, test faults
    if tplan.cuda_graphs:
        trainer.add_callback(stable_gradients(model))
    load_peak_reserved = None
    if on_gpu:
        load_peak_reserved = torch.cuda.max_memory_reserved() / 2**20  # loading, dequantizing, wrapping
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    clock = StepClock(collator, model, device_events() if on_gpu else None)
    trainer.add_callback(_callbacks(batch_args["max_steps"], collator, clock, out, started, t.save_total_limit))
    deferred = None
    if tplan.compile_layers and tplan.compile_deferred:  # after the callback that feeds the clock
        def say(line: str) -> None:
            if trainer.is_world_process_zero():
                print(line, flush=True)

        where = job.get("compile_record")  # the store and GPU model that record what compiling took
        record = cost_entry(Path(where["cache"]), where["gpus"], layer_key(model.config)) if where else None
        deferred = compile_when_it_pays(model, clock, record, gather, say, cuda_graphs=tplan.cuda_graphs)
        trainer.add_callback(deferred)
    shared, resume = prepare_ranks(trainer, out)  # who writes, where to resume from
    # read now: with save_total_limit, the checkpoint resumed from is rotated out during training
    resumed_from = checkpoint_step(resume) if resume is not None else None
    if fsdp:
        sharding.check_storage(shared)
    if job.get("profile") and on_gpu:  # the training benchmark's "where does the time go" window
        trainer.add_callback(profiler_callback(Path(job["profile"]["path"]), job["profile"]["start"],
                                               job["profile"]["steps"], clock.exclude))
    if trainer.is_world_process_zero():
        print(f"training: {layout}; {'fsdp' if fsdp else 'ddp'}; "
              f"checkpointing {'on' if tplan.gradient_checkpointing else 'off'}; "
              f"liger {'on' if use_liger else 'off'}; frozen weights in {'fp32' if upcast else plan.compute_dtype}"
              + ("; NF4 base dequantized" if tplan.dequantize_base else "")
              + ("" if not tplan.compile_layers else "; decoder layers compiled" if deferred is None else
                 "; decoder layers compiled if the first steps show the run repays it (train.compile=auto)"),
              flush=True)
        if resume is not None:
            print(f"resuming from {resume.name} (optimizer, scheduler and RNG state restored)", flush=True)
    # The weights and the adapter before the first step (the optimizer's state comes in it): the planner's static part.
    loaded_allocated = torch.cuda.memory_allocated() / 2**20 if on_gpu else None
    if resume is not None and 0 < steps <= resumed_from:
        # Killed after its final checkpoint: resuming would take one step past max_steps, so restore that state.
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file
        from transformers import TrainerState

        set_peft_model_state_dict(model, load_file(resume / "adapter_model.safetensors"))
        trainer.state = TrainerState.load_from_json(str(resume / "trainer_state.json"))
    else:
        train_with_frozen_heap(trainer, resume)
    clock.settle()  # every step's time, once the device has run it
    seconds = time.perf_counter() - started
    compiled = compile_stats() if tplan.compile_layers else None
    if compiled and trainer.is_world_process_zero():
        print(describe_compile(compiled), flush=True)

    outside_allocator = None
    if on_gpu:
        peak_reserved = torch.cuda.max_memory_reserved() / 2**20
        peak_allocated = torch.cuda.max_memory_allocated() / 2**20
        free, total = torch.cuda.mem_get_info()  # the whole device: our CUDA context, libraries' own buffers, others
        outside_allocator = (total - free - torch.cuda.memory_reserved()) / 2**20
        alloc_retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)  # frees-and-retries at the cap
    else:
        peak_reserved = peak_allocated = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        alloc_retries = None
    record = {"rank": rank, "global_step": trainer.state.global_step, "tokens": collator.tokens,
              "peak_reserved_mb": peak_reserved, "peak_allocated_mb": peak_allocated,
              "loaded_allocated_mb": loaded_allocated, "load_peak_reserved_mb": load_peak_reserved,
              "outside_allocator_mb": outside_allocator, "alloc_retries": alloc_retries,
              "device_name": torch.cuda.get_device_name() if on_gpu else "cpu", "steps": clock.steps,
              "param_mb": sharding.local_parameter_mib(model)}
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    adapter_state = sharding.gather_adapter(model)  # under FSDP a collective: the full adapter on every rank
    records = gather(record)  # bookkeeping through the process group, not a shared directory
    if not is_writer(shared):
        return None

    adapter = out / "adapter"
    tmp = out / ".adapter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=adapter_state)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(adapter, ignore_errors=True)
    os.replace(tmp, adapter)
    curve = [(int(e["step"]), float(e["loss"])) for e in trainer.state.log_history if "loss" in e]
    total_tokens = sum(r["tokens"] for r in records)
    # the training bench names the warm-up its other rows leave out too (steady_warmup)
    steady = steady_state(clock.steps, sum(r["tokens"] for r in records) / max(record["tokens"], 1),
                          job.get("steady_warmup"))
    result = dict(
        adapter_path=str(adapter), output_dir=str(out), fingerprint=job["fingerprint"],
        steps=trainer.state.global_step, world_size=world, device=plan.device, loss_curve=curve,
        first_loss=curve[0][1], final_loss=curve[-1][1], tokens_per_second=round(total_tokens / seconds, 1),
        train_tokens=total_tokens, train_seconds=round(seconds, 2),
        peak_memory_mb=round(max(r["peak_reserved_mb"] for r in records), 1),
        peak_allocated_mb=round(max(r["peak_allocated_mb"] for r in records), 1),
        loaded_allocated_mb=None if not on_gpu else round(max(r["loaded_allocated_mb"] for r in records), 1),
        load_peak_reserved_mb=None if not on_gpu else round(max(r["load_peak_reserved_mb"] for r in records), 1),
        outside_allocator_mb=None if not on_gpu else round(max(r["outside_allocator_mb"] for r in records), 1),
        alloc_retries=None if not on_gpu else max(r["alloc_retries"] for r in records),
        step_seconds=[round(sec, 4) for _, sec, _, _ in clock.steps],
        steady_tokens_per_second=steady["tokens_per_second"], steady_state=steady,
        resumed_from_step=resumed_from,
        backend=backend, rank_steps=[r["global_step"] for r in records],
        devices=[r["device_name"] for r in records], rank_tokens=[r["tokens"] for r in records],
        rank_param_mb=[round(r["param_mb"], 3) for r in records],
        training_plan=tplan.model_dump(), micro_batch_split=split, layout=layout, strategy=plan.strategy,
        compile_stats=compiled,
        **(deferred.summary() if deferred is not None else
           {"compiled_at_step": 0 if tplan.compile_layers else None, "compile_seconds": None}),
    )
    write_json(out / "train_metrics.json", result)
    print(f"trained {result['steps']} steps on {world} {plan.device} rank(s): loss {result['first_loss']:.4f} -> "
          f"{result['final_loss']:.4f}, {result['tokens_per_second']} tokens/s ({steady_text(steady)}), peak "
          f"reserved {result['peak_memory_mb']} MiB", flush=True)
    return result


def _torchrun_rank(job: dict) -> dict | None:
    """A torchrun rank: train, then close the process group before the interpreter exits (left to teardown at
    exit, a gloo rank aborted now and then with "terminate called without an active exception" after rank 0 had
    written the metrics, failing a finished attempt; Ray Train closes its own group)."""
    import torch.distributed as dist

    result = _train(job)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    single_rank_defaults()  # one CPU rank runs without torchrun (finetune_flows.training.distributed.train_command)
    worker_main(_torchrun_rank)
