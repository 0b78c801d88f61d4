"""The run's summary: what was produced where, which steps came from cache, and the headline numbers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pydantic import BaseModel

from finetune_flows.files import write_atomic
from finetune_flows.orchestration.caching import StepRun
from finetune_flows.reporting.compare import publish_comparison
from finetune_flows.evaluation.evaluate import EvalReport
from finetune_flows.export.merge import ExportResult
from finetune_flows.reporting.plots import plots_markdown, publish_plots
from finetune_flows.reporting.tracking import copy_tensorboard_logs
from finetune_flows.training.train import TrainResult


class FinetuneResult(BaseModel):
    run_dir: Path
    adapter_path: Path
    cached_steps: list[str]
    step_seconds: dict[str, float] = {}  # wall time of each step in this run (a cached one: checking and reading)
    train: TrainResult
    eval: EvalReport
    plots: list[Path] = []
    tensorboard_dir: Path | None = None
    merged: ExportResult | None = None
    previous_run: Path | None = None


def finish_run(run_dir: Path, train: TrainResult, report: EvalReport, steps: dict[str, StepRun],
               merged: ExportResult | None, report_to: list[str]) -> FinetuneResult:
    """Copy the adapter and the TensorBoard logs into the run directory, draw the plots, compare with the
    previous run, publish the run's artifacts, and write summary.json last (it marks the run complete)."""
    # Prefect here, not at the top: the engine imports without it
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    adapter = run_dir / "adapter"
    shutil.copytree(train.adapter_path, adapter)
    shutil.copy(report.path, run_dir / "eval.json")
    result = FinetuneResult(run_dir=run_dir, adapter_path=adapter, train=train, eval=report, merged=merged,
                            cached_steps=[name for name, step in steps.items() if step.cached],
                            step_seconds={name: step.seconds for name, step in steps.items()},
                            tensorboard_dir=copy_tensorboard_logs(train.output_dir, run_dir, report_to),
                            plots=publish_plots(run_dir, train, report))
    result.previous_run = publish_comparison(run_dir, result.model_dump(mode="json"))

    create_table_artifact(
        [{"step": s, "loss": round(loss, 4)} for s, loss in train.loss_curve], key="train-loss",
        description=f"Loss per logged step; {train.tokens_per_second} tokens/s on {train.world_size} "
                    f"{train.device} rank(s), peak memory {train.peak_memory_mb} MiB",
    )
    create_table_artifact(
        [{"step": name, "cached": step.cached, "seconds": step.seconds} for name, step in steps.items()],
        key="step-cache", description="Which steps were reused from cache in this run, and each step's wall time",
    )
    create_link_artifact(adapter.as_uri(), link_text=str(adapter), key="adapter-location",
                         description="The trained LoRA adapter (load with peft.PeftModel.from_pretrained)")
    create_markdown_artifact(render_summary(result) + "\n" + plots_markdown(result.plots), key="run-summary",
                             description="Run summary: eval table, plots, where everything is")
    write_atomic(run_dir / "summary.json", result.model_dump_json(indent=2))
    return result


def render_summary(r: FinetuneResult) -> str:
    e = r.eval
    rows = "\n".join("| " + " | ".join(str(v) for v in row.values()) + " |" for row in e.table())
    header = "| " + " | ".join(e.table()[0].keys()) + " |\n|" + "---|" * len(e.table()[0])
    return (f"# Fine-tune run {r.run_dir.name}\n\n{header}\n{rows}\n\n"
            f"- adapter: `{r.adapter_path}`\n- training: {r.train.steps} steps, loss {r.train.first_loss:.4f} -> "
            f"{r.train.final_loss:.4f}, {r.train.tokens_per_second} tokens/s, peak {r.train.peak_memory_mb} MiB\n"
            f"- held out: {e.eval_rows} rows evaluated; {e.held_out_note}\n"
            f"- cached steps: {', '.join(r.cached_steps) or 'none'}\n"
            + (f"- step seconds: {', '.join(f'{n} {s:g}' for n, s in r.step_seconds.items())}\n"
               if r.step_seconds else "")
            + (f"- merged checkpoint: `{r.merged.path}` ({r.merged.dtype}, logits within "
               f"{r.merged.logit_error:.2g} std of base + adapter)\n" if r.merged else "")
            + (f"- plots: {', '.join(f'`{p}`' for p in r.plots)}\n" if r.plots else "")
            + (f"- TensorBoard: `tensorboard --logdir {r.tensorboard_dir}`\n" if r.tensorboard_dir else "")
            + f"- previous run: {f'`{r.previous_run.name}` (see comparison.md)' if r.previous_run else 'none'}\n")


def print_table(r: FinetuneResult) -> None:
    print(render_summary(r))
    print(json.dumps({"run_dir": str(r.run_dir), "cached_steps": r.cached_steps}))
