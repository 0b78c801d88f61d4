"""Step 6: base model versus base + adapter on the held-out split (and `flows/evaluate.py` on a merged checkpoint).

Loss/perplexity on the answer tokens, and generation metrics (exact match and contains, metrics.py) from
greedy decoding with the resolved attention backend. Runs in a child process on the first selected GPU (or the
CPU). The report says how many held-out rows were dropped as copies of training prompts, and what the base
model's score means (format vs ability).

A merged checkpoint (export/merge.py) is scored by `evaluate_checkpoint`: the same worker and engines on the same
held-out rows, the base beside it, in a store entry keyed by the checkpoint's content (its weights, config and
tokenizer; not its path, nor its model card).
"""

from __future__ import annotations

from pathlib import Path

from typing import Any, Callable

from pydantic import BaseModel

from finetune_flows.orchestration.concurrency import device_slots
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.data.dataset import PreparedDataset
from finetune_flows.export.merge import RECORD as EXPORT_RECORD
from finetune_flows.config.plan import Plan, worker_config
from finetune_flows.store.fingerprint import combine, hash_bytes_of, hash_tree, step_versions
from finetune_flows.runtime.gpus import GpuSelection
from finetune_flows.runtime.launcher import compile_caches, python_module, run_worker, write_job
from finetune_flows.logs import run_logger
from finetune_flows.evaluation.metrics import METRICS, explain, rates
from finetune_flows.models.quantize import QuantizedModel
from finetune_flows.files import write_atomic
from finetune_flows.store.entries import MANIFEST, Entry, reuse_or_produce, step_state


class ModelScores(BaseModel):
    loss: float
    perplexity: float
    generation_score: float | None  # exact match (or `contains`) rate on generated answers; None for text data
    generated: int
    generate_seconds: float
    first_result_seconds: float | None = None  # until the first answer was complete
    generated_tokens: int | None = None  # new tokens, stop tokens excluded


# The models a report can hold: (its key in the report, its row in the eval table).
MODELS = (("base", "base"), ("adapter", "base + adapter"), ("merged", "merged"))


class EvalReport(BaseModel):
    base: ModelScores
    adapter: ModelScores | None = None  # None only for a merged checkpoint evaluated without its adapter
    merged: ModelScores | None = None  # flows/evaluate.py on a merged checkpoint
    metric: str
    engine: str = "generate"  # the generation engine that produced the answers (generation.py)
    kernelized: dict[str, int] = {}  # Hub kernel layer name -> modules replaced (hardware.kernels)
    dtype: str = ""  # compute dtype the answers and losses were computed in
    attn_implementation: str
    device: str
    eval_rows: int
    samples: list[dict[str, str]]  # a few prompts with reference, base and adapter answers
    path: Path
    references: list[str] = []
    predictions: dict[str, list[str]] = {}  # model ("base"/"adapter"/"merged") -> greedy answer per reference
    rates: dict[str, dict[str, float]] = {}  # model -> metric -> share of answers (every metric, not just the headline)
    held_out_removed: int = 0  # held-out rows dropped because their prompt is in training (exact or folded)
    held_out_note: str = ""  # how many were dropped and why (PreparedDataset.removed_note)
    explanation: str = ""  # what the base model's score means: format vs ability
    long_references: int = 0  # references longer than max_new_tokens: cut answers that cannot match
    max_new_tokens: int = 0

    def models(self) -> list[tuple[str, str, ModelScores]]:
        """(key, row name, scores) of each model this report scored, in table order."""
        return [(key, name, getattr(self, key)) for key, name in MODELS if getattr(self, key) is not None]

    def table(self) -> list[dict[str, object]]:
        rows = []
        for key, name, s in self.models():
            row: dict[str, object] = {"model": name, "eval loss": round(s.loss, 4),
                                      "perplexity": round(s.perplexity, 3)}
            for metric in METRICS if self.rates else (self.metric,):
                value = self.rates[key].get(metric) if self.rates else s.generation_score
                row[metric] = None if value is None else round(value, 4)
            row.update({"examples generated": s.generated, "attention": self.attn_implementation,
                        "dtype": self.dtype})  # bf16 and fp32 answers can differ where two tokens nearly tie
            rows.append(row)
        return rows


def with_metrics(report: EvalReport, data: PreparedDataset) -> EvalReport:
    """Every metric from the answers, the held-out dedup count, and the base score explained."""
    scores = {key: rates(report.predictions.get(key, []), report.references) for key, _, _ in report.models()}
    tuned, name, _ = report.models()[1]  # the adapter's row where there is one, else the merged checkpoint's
    return report.model_copy(update={
        "rates": scores if scores["base"] else {},
        "explanation": explain(scores["base"], scores[tuned], name, report.long_references, report.max_new_tokens),
        "held_out_removed": data.eval_removed_exact + data.eval_removed_normalized,
        "held_out_note": data.removed_note()})


def _key_parts(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, plan: Plan,
               step: str) -> dict[str, Any]:
    # eval.attn_implementation is in the key as what it resolved to (plan.eval_attn), not as written; hardware.kernels
    # swaps layers' implementations (models/kernels.py)
    return {"data": data.fingerprint, "base": base.fingerprint,
            "eval": cfg.eval.model_dump(mode="json", exclude={"attn_implementation"}),
            "attention": plan.eval_attn, "dtype": plan.eval_dtype, "device": plan.device,
            "kernels": cfg.hardware.kernels, **step_versions(step)}


def eval_key_parts(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter_path: Path,
                   plan: Plan) -> dict[str, Any]:
    """Everything the evaluation depends on (the README's cache-key table lists the same)."""
    return {**_key_parts(cfg, data, base, plan, "evaluate-adapter"), "adapter": hash_tree(adapter_path)}


def eval_fingerprint(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter_path: Path,
                     plan: Plan) -> str:
    return combine(eval_key_parts(cfg, data, base, adapter_path, plan))


# Files of a merged checkpoint the evaluation does not read: its model card (it names the run's paths, so every
# copy of the same weights has another one), the store's manifest and the export record of the cache entry.
NOT_READ = ("README.md", MANIFEST, EXPORT_RECORD)


def checkpoint_fingerprint(checkpoint: Path) -> str:
    """The checkpoint's content: weights, config, tokenizer. Its copy in a run directory and its cache entry
    have the same one; a byte changed in a weight file gives another."""
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name not in NOT_READ
                   and not p.name.startswith("."))
    return combine([(str(p.relative_to(checkpoint)), hash_bytes_of([p])) for p in files])


def checkpoint_key_parts(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, checkpoint: Path,
                         plan: Plan) -> dict[str, Any]:
    """What a merged checkpoint's evaluation depends on (the README's cache-key table lists the same): the
    adapter evaluation's key with the checkpoint's content in place of the adapter's."""
    return {**_key_parts(cfg, data, base, plan, "evaluate-checkpoint"),
            "checkpoint": checkpoint_fingerprint(checkpoint)}


def checkpoint_eval_fingerprint(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, checkpoint: Path,
                                plan: Plan) -> str:
    return combine(checkpoint_key_parts(cfg, data, base, checkpoint, plan))


def publish_eval(report: EvalReport) -> None:
    # Prefect here, not at the top: the engine imports without it
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    models = report.models()
    create_table_artifact(report.table(), key="eval-metrics",
                          description=f"Held-out evaluation ({report.eval_rows} rows; {report.held_out_note}), "
                                      f"{' vs '.join(name for _, name, _ in models)}. "
                                      f"Headline metric: {report.metric}. {report.explanation}")
    lines = [report.explanation, "",
             f"Before evaluation, {report.held_out_note}: their prompt is also in the training split.", "",
             "| reference | " + " | ".join(key for key, _, _ in models) + " |", "|---" * (len(models) + 1) + "|"]
    lines += ["| " + " | ".join([s["reference"], *(repr(s.get(key, "").strip()[:60]) for key, _, _ in models)]) + " |"
              for s in report.samples]
    create_markdown_artifact("\n".join(lines), key="eval-samples", description="Greedy answers on held-out prompts")


def _producer(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, plan: Plan, gpus: GpuSelection,
              entry: Entry, **model: str) -> Callable[[], EvalReport]:
    """The evaluation worker run on `model` (adapter=DIR or checkpoint=DIR), writing the entry's eval.json."""
    out = entry.path / "eval.json"

    def produce() -> EvalReport:
        job = write_job(entry.path, "evaluate", config=worker_config(cfg, plan, gpus.ids, data.format),
                        plan=plan.model_dump(mode="json"), base=str(base.path),
                        base_model=base.model_dump(mode="json"), data=str(data.path), out=str(out), **model)
        with device_slots(gpus.ids):  # lock order: the entry's lock (held by the caller), then the device
            env = {**gpus.env, **compile_caches(cfg.cache_root, gpus)}
            run_worker("evaluate", python_module("finetune_flows.evaluation.worker", job), env, entry.path)
        report = with_metrics(EvalReport.model_validate_json(out.read_text()), data)
        write_atomic(out, report.model_dump_json(indent=2))
        return report

    return produce


def _log_scores(report: EvalReport) -> None:
    run_logger().info("eval (%s): %s", report.attn_implementation, " | ".join(
        f"{key} {report.metric}={s.generation_score} loss={s.loss:.4f}" for key, _, s in report.models()))


def evaluate_adapter(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter_path: Path,
                     plan: Plan, gpus: GpuSelection):
    """Score base and base + adapter, reusing a verified evaluation of the same inputs."""
    entry = Entry(cfg.cache_root, "evals", eval_fingerprint(cfg, data, base, adapter_path, plan))
    produce = _producer(cfg, data, base, plan, gpus, entry, adapter=str(adapter_path))
    report, reused = reuse_or_produce(entry, EvalReport, produce, outputs=["eval.json"])
    _log_scores(report)
    return step_state(report, reused, entry)


def evaluate_checkpoint(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, checkpoint: Path,
                        plan: Plan, gpus: GpuSelection):
    """Score base and a merged checkpoint, reusing a verified evaluation of the same inputs (keyed by the
    checkpoint's content, wherever it lies)."""
    entry = Entry(cfg.cache_root, "evals", checkpoint_eval_fingerprint(cfg, data, base, checkpoint, plan))
    produce = _producer(cfg, data, base, plan, gpus, entry, checkpoint=str(checkpoint))
    report, reused = reuse_or_produce(entry, EvalReport, produce, outputs=["eval.json"])
    _log_scores(report)
    return step_state(report, reused, entry)


def beside_adapter(merged: EvalReport, adapter: EvalReport, data: PreparedDataset) -> EvalReport:
    """One table for a merged checkpoint and the adapter it was made from: the adapter evaluation (base and
    base + adapter) with the merged checkpoint's row, answers and samples added (the same held-out prompts)."""
    samples = [{**a, "merged": m.get("merged", "")} for a, m in zip(adapter.samples, merged.samples)]
    return with_metrics(adapter.model_copy(update={
        "merged": merged.merged, "predictions": {**adapter.predictions, "merged": merged.predictions["merged"]},
        "samples": samples, "path": merged.path}), data)
