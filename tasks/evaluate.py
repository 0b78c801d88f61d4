"""Step 6: base model versus base + adapter on the held-out split.

Loss/perplexity on the answer tokens, and a generation metric (exact match by default) from greedy decoding
with the resolved attention backend. Runs in a child process on the first selected GPU (or the CPU).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel

from tasks.concurrency import produce_on_devices
from tasks.config import FinetuneConfig
from tasks.dataset import PreparedDataset
from tasks.environment import Plan
from tasks.errors import retry_unless_user_error
from tasks.fingerprint import code_version, combine, hash_tree
from tasks.gpus import GpuSelection
from tasks.launcher import python_module, run_logger, run_worker, write_job
from tasks.quantize import QuantizedModel


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

    def is_complete(self) -> bool:
        return self.path.is_file()

    def table(self) -> list[dict[str, object]]:
        rows = []
        for name, s in (("base", self.base), ("base + adapter", self.adapter)):
            rows.append({"model": name, "eval loss": round(s.loss, 4), "perplexity": round(s.perplexity, 3),
                         self.metric: None if s.generation_score is None else round(s.generation_score, 4),
                         "examples generated": s.generated, "attention": self.attn_implementation})
        return rows


def eval_fingerprint(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter_path: Path,
                     plan: Plan) -> str:
    return combine(data.fingerprint, base.fingerprint, hash_tree(adapter_path), cfg.eval.fingerprint(),
                   plan.eval_attn, plan.eval_dtype, plan.device,
                   code_version("evaluate", "eval_worker", "metrics", "generation", "dequantize"))



def publish_eval(report: EvalReport) -> None:
    create_table_artifact(report.table(), key="eval-metrics",
                          description=f"Held-out evaluation ({report.eval_rows} rows), base vs base + adapter")
    lines = ["| reference | base | adapter |", "|---|---|---|"]
    lines += [f"| {s['reference']} | {s['base'].strip()[:60]!r} | {s['adapter'].strip()[:60]!r} |"
              for s in report.samples]
    create_markdown_artifact("\n".join(lines), key="eval-samples", description="Greedy answers on held-out prompts")


def _eval_key(context, parameters) -> str:
    p = parameters
    return "eval-" + eval_fingerprint(p["cfg"], p["data"], p["base"], p["adapter_path"], p["plan"])


@task(name="evaluate-adapter", cache_key_fn=_eval_key, persist_result=True, retries=1, retry_delay_seconds=10,
      retry_condition_fn=retry_unless_user_error, tags=["evaluation", "device"],
      task_run_name="evaluate-adapter[{cfg.run.name}: {cfg.eval.max_samples} samples, {plan.eval_attn}]")
def evaluate_adapter(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter_path: Path,
                     plan: Plan, gpus: GpuSelection) -> EvalReport:
    """Score base and base + adapter; publish the comparison table (artifact key `eval-metrics`)."""
    fingerprint = eval_fingerprint(cfg, data, base, adapter_path, plan)
    out = cfg.cache_root / "evals" / fingerprint / "eval.json"

    def launch() -> None:
        job = write_job(out.parent, "evaluate", config=cfg.model_dump(mode="json"), plan=plan.model_dump(),
                        base=str(base.path), base_model=base.model_dump(mode="json"), data=str(data.path),
                        adapter=str(adapter_path), out=str(out))
        run_worker("evaluate", python_module("tasks.eval_worker", job), gpus.env, out.parent)

    produce_on_devices(out, gpus.ids, launch)
    report = EvalReport.model_validate_json(out.read_text())
    run_logger().info("eval (%s): base %s=%s loss=%.4f | adapter %s=%s loss=%.4f", report.attn_implementation,
                      report.metric, report.base.generation_score, report.base.loss, report.metric,
                      report.adapter.generation_score, report.adapter.loss)
    return report

