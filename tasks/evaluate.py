"""Step 6: base model versus base + adapter on the held-out split.

Loss/perplexity on the answer tokens, and generation metrics (exact match and contains, tasks/metrics.py) from
greedy decoding with the resolved attention backend. Runs in a child process on the first selected GPU (or the
CPU). The report says how many held-out rows were dropped as copies of training prompts, and what the base
model's score means (format vs ability).
"""

from __future__ import annotations

from pathlib import Path

from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.concurrency import device_slots
from tasks.config import FinetuneConfig
from tasks.dataset import PreparedDataset
from tasks.environment import Plan
from tasks.errors import retry_unless_user_error
from tasks.fingerprint import combine, hash_tree, step_versions
from tasks.gpus import GpuSelection
from tasks.launcher import python_module, run_logger, run_worker, write_job
from tasks.metrics import METRICS, explain, rates
from tasks.quantize import QuantizedModel
from tasks.store import Entry, reuse_or_produce, step_state, write_atomic


class ModelScores(BaseModel):
    loss: float
    perplexity: float
    generation_score: float | None  # exact match (or `contains`) rate on generated answers; None for text data
    generated: int
    generate_seconds: float
    first_result_seconds: float | None = None  # until the first answer was complete
    generated_tokens: int | None = None  # new tokens, stop tokens excluded


class EvalReport(BaseModel):
    base: ModelScores
    adapter: ModelScores
    metric: str
    engine: str = "generate"  # the generation engine that produced the answers (tasks/generation.py)
    kernelized: dict[str, int] = {}  # Hub kernel layer name -> modules replaced (hardware.kernels)
    dtype: str = ""  # compute dtype the answers and losses were computed in
    attn_implementation: str
    device: str
    eval_rows: int
    samples: list[dict[str, str]]  # a few prompts with reference, base and adapter answers
    path: Path
    references: list[str] = []
    predictions: dict[str, list[str]] = {}  # model ("base"/"adapter") -> greedy answer per reference
    rates: dict[str, dict[str, float]] = {}  # model -> metric -> share of answers (every metric, not just the headline)
    held_out_removed: int = 0  # held-out rows dropped because their prompt is in training (exact or folded)
    explanation: str = ""  # what the base model's score means: format vs ability

    def table(self) -> list[dict[str, object]]:
        rows = []
        for name, key, s in (("base", "base", self.base), ("base + adapter", "adapter", self.adapter)):
            row: dict[str, object] = {"model": name, "eval loss": round(s.loss, 4),
                                      "perplexity": round(s.perplexity, 3)}
            for metric in METRICS if self.rates else (self.metric,):
                value = self.rates[key].get(metric) if self.rates else s.generation_score
                row[metric] = None if value is None else round(value, 4)
            row.update({"examples generated": s.generated, "attention": self.attn_implementation})
            rows.append(row)
        return rows


def with_metrics(report: EvalReport, data: PreparedDataset) -> EvalReport:
    """Every metric from the answers, the held-out dedup count, and the base score explained."""
    scores = {name: rates(report.predictions.get(name, []), report.references) for name in ("base", "adapter")}
    return report.model_copy(update={
        "rates": scores if scores["base"] else {}, "explanation": explain(scores["base"], scores["adapter"]),
        "held_out_removed": data.eval_removed_exact + data.eval_removed_normalized})


def eval_key_parts(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter_path: Path,
                   plan: Plan) -> dict[str, Any]:
    """Everything the evaluation depends on (the README's cache-key table lists the same)."""
    return {"data": data.fingerprint, "base": base.fingerprint, "adapter": hash_tree(adapter_path),
            "eval": cfg.eval.model_dump(mode="json"), "attention": plan.eval_attn, "dtype": plan.eval_dtype, "device": plan.device,
            **step_versions("evaluate-adapter")}


def eval_fingerprint(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter_path: Path,
                     plan: Plan) -> str:
    return combine(eval_key_parts(cfg, data, base, adapter_path, plan))


def publish_eval(report: EvalReport) -> None:
    create_table_artifact(report.table(), key="eval-metrics",
                          description=f"Held-out evaluation ({report.eval_rows} rows; {report.held_out_removed} "
                                      "held-out rows removed as copies of training prompts), base vs base + adapter. "
                                      f"Headline metric: {report.metric}. {report.explanation}")
    lines = [report.explanation, "",
             f"{report.held_out_removed} held-out rows were removed before evaluation because their prompt is also "
             "in the training split (exactly, or after folding case, digits and whitespace).", "",
             "| reference | base | adapter |", "|---|---|---|"]
    lines += [f"| {s['reference']} | {s['base'].strip()[:60]!r} | {s['adapter'].strip()[:60]!r} |"
              for s in report.samples]
    create_markdown_artifact("\n".join(lines), key="eval-samples", description="Greedy answers on held-out prompts")


@task(name="evaluate-adapter", persist_result=False, cache_policy=NO_CACHE, retries=1, retry_delay_seconds=10,
      retry_condition_fn=retry_unless_user_error, tags=["evaluation", "device"],
      task_run_name="evaluate-adapter[{cfg.run.name}: {cfg.eval.max_samples} samples, {plan.eval_attn}]")
def evaluate_adapter(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter_path: Path,
                     plan: Plan, gpus: GpuSelection):
    """Score base and base + adapter, reusing a verified evaluation of the same inputs."""
    entry = Entry(cfg.cache_root, "evals", eval_fingerprint(cfg, data, base, adapter_path, plan))
    out = entry.path / "eval.json"

    def produce() -> EvalReport:
        job = write_job(entry.path, "evaluate", config=cfg.model_dump(mode="json"), plan=plan.model_dump(),
                        base=str(base.path), base_model=base.model_dump(mode="json"), data=str(data.path),
                        adapter=str(adapter_path), out=str(out))
        with device_slots(gpus.ids):  # lock order: the entry's lock (held by the caller), then the device
            run_worker("evaluate", python_module("tasks.eval_worker", job), gpus.env, entry.path)
        report = with_metrics(EvalReport.model_validate_json(out.read_text()), data)
        write_atomic(out, report.model_dump_json(indent=2))
        return report

    report, reused = reuse_or_produce(entry, EvalReport, produce, outputs=["eval.json"])
    run_logger().info("eval (%s): base %s=%s loss=%.4f | adapter %s=%s loss=%.4f", report.attn_implementation,
                      report.metric, report.base.generation_score, report.base.loss, report.metric,
                      report.adapter.generation_score, report.adapter.loss)
    return step_state(report, reused, entry)
