"""What the scale-out benchmarks share (benchmarks/scale_out.py: strategies; benchmarks/scale_launchers.py:
launchers): the run's config and plan, its 4-bit base and workload, a run's metrics row, loss curves compared, the
report's head."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.train_speed import generate_on_gpu


def host_hardware(args, gpu_ids: list[int]) -> list[str]:
    """One host: the given GPUs, or --ranks CPU processes."""
    if gpu_ids:
        return [f"hardware.gpus={','.join(map(str, gpu_ids))}"]
    return ["hardware.gpus=cpu", f"hardware.cpu_processes={args.ranks}"]


def config(args, cache: Path, strategy: str, hardware: list[str]):
    from finetune_flows.config.schema import load_config

    return load_config(None, [f"model.source=generated:{args.shape}", f"run.cache_dir={cache}",
                              f"train.max_steps={args.steps}", "train.per_device_batch_size=8",
                              f"train.gradient_accumulation_steps={args.accumulation}",
                              f"train.learning_rate={args.learning_rate}", f"train.warmup_steps={args.warmup}",
                              "train.logging_steps=1", f"train.save_steps={10**6}", "train.save_total_limit=1",
                              f"hardware.strategy={strategy}", *hardware, *args.set])


def resolved(cfg, env, ids: list[int]):
    """(GPU selection, plan) for this config on these GPUs (the CPU when none), refusing another strategy."""
    from finetune_flows.runtime.environment import resolve_plan
    from finetune_flows.runtime.gpus import selection_for

    sel = selection_for(",".join(map(str, ids)) if ids else "cpu", env.gpus)
    plan = resolve_plan(cfg, env, sel)
    if plan.strategy != cfg.hardware.strategy:
        raise SystemExit(f"{cfg.hardware.strategy}: the plan trains with {plan.strategy} ({plan.strategy_choice})")
    return sel, plan


def quantized_base(cfg, plan, sel, work: Path):
    """The 4-bit base for this plan's strategy, through the store (shared with flow runs on the same cache)."""
    from finetune_flows.runtime.launcher import python_module, run_worker, write_job
    from finetune_flows.models.quantize import QuantizedModel, quantize_fingerprint
    from finetune_flows.training.sharding import quant_storage
    from finetune_flows.store.entries import Entry, reuse_or_produce

    if plan.device == "cuda":
        generate_on_gpu(cfg.model.source, cfg.cache_root, sel.ids[0])
    entry = Entry(cfg.cache_root, "quantized", quantize_fingerprint(cfg, plan))

    def produce() -> QuantizedModel:
        job = write_job(work, "quantize", config=cfg.model_dump(mode="json"), out=str(entry.path),
                        compute_dtype=plan.compute_dtype, fingerprint=entry.key,
                        quant_storage=quant_storage(plan.strategy, plan.compute_dtype))
        run_worker("quantize", python_module("finetune_flows.models.quantize", job), sel.env, work)
        return QuantizedModel.model_validate_json((entry.path / "quantization.json").read_text())

    return reuse_or_produce(entry, QuantizedModel, produce, outputs=["."])[0]


def workload_dataset(data: Path, stats: dict):
    from finetune_flows.data.dataset import PreparedDataset

    return PreparedDataset(path=data, fingerprint="bench", format="text", train_rows=stats["rows"],
                           eval_rows=stats["eval_rows"], train_tokens=stats["tokens"], truncated=0, dropped=0)


def fresh(out: Path) -> Path:
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: no resume from an earlier one's checkpoints
    out.mkdir(parents=True)
    return out


def metrics_row(r: dict, smi_peak_mib: float) -> dict:
    """What both kinds of report show of a run, from its train_metrics.json."""
    steady = r["steady_state"]
    return {"tokens_per_second": steady["tokens_per_second"], "tokens_per_second_min": steady["min"],
            "tokens_per_second_max": steady["max"], "windows": steady["windows"],
            "whole_run_tokens_per_second": r["tokens_per_second"], "train_tokens": r["train_tokens"],
            "train_seconds": r["train_seconds"], "steps": r["steps"], "ranks": r["world_size"],
            "backend": r.get("backend"), "peak_reserved_gib": round(r["peak_memory_mb"] / 1024, 2),
            "nvidia_smi_peak_gib": round(smi_peak_mib / 1024, 2) if smi_peak_mib else None,
            "loss_curve": r["loss_curve"], "final_loss": r["loss_curve"][-1][1], "layout": r["layout"]}


def loss_difference(curve: list, reference: list) -> tuple[float | None, int]:
    """The largest absolute loss difference at the steps both curves logged, and how many steps that was."""
    losses = dict(map(tuple, reference))
    diffs = [abs(loss - losses[step]) for step, loss in curve if step in losses]
    return (round(max(diffs), 6) if diffs else None), len(diffs)


def head_lines(rep: dict, title: str) -> list[str]:
    gpus = rep["gpus"]
    where = f"{len(gpus)} x {gpus[0]['name']}" if gpus else f"CPU, {rep['ranks']} ranks (gloo)"
    return [f"# {title}: {where}", "", f"- date: {rep['date']}", f"- command: `{rep['command']}`",
            f"- host {rep['host']}, driver {rep['driver']}, CUDA {rep['cuda']}, python {rep['python']}",
            "- versions: " + ", ".join(f"{k} {v}" for k, v in rep["versions"].items() if v),
            f"- workload: {rep['workload']['rows']} rows, lengths median {rep['workload']['median_length']}, "
            f"{rep['workload']['tokens']} tokens; {rep['steps']} steps", ""]
