"""Step 6: base model versus base + adapter on the held-out split.

Loss/perplexity on the answer tokens, and a generation metric (exact match by default) from greedy decoding
with the resolved attention backend. Runs in a child process on the first selected GPU (or the CPU).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel

from tasks.concurrency import produce_on_devices
from tasks.config import FinetuneConfig
from tasks.dataset import IGNORE_INDEX, PreparedDataset, load_split
from tasks.environment import Plan
from tasks.errors import retry_unless_user_error
from tasks.fingerprint import code_version, combine, hash_tree
from tasks.gpus import GpuSelection
from tasks.launcher import python_module, run_logger, run_worker, worker_main, write_job
from tasks.quantize import QuantizedModel, torch_dtype
from tasks.train import PadCollator


class ModelScores(BaseModel):
    loss: float
    perplexity: float
    generation_score: float | None  # exact match (or `contains`) rate on generated answers; None for text data
    generated: int
    generate_seconds: float


class EvalReport(BaseModel):
    base: ModelScores
    adapter: ModelScores
    metric: str
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
                   plan.eval_attn, plan.device, code_version("evaluate"))


def score_answer(prediction: str, reference: str, metric: str) -> bool:
    p, r = prediction.strip().lower(), reference.strip().lower()
    return p == r if metric == "exact_match" else r in p


# ---------------------------------------------------------------- worker side


def _loss(model, dataset, batch_size: int, pad_id: int, device) -> float:
    import torch

    total, count = 0.0, 0
    for start in range(0, len(dataset), batch_size):
        batch = PadCollator(pad_id)(dataset[start:start + batch_size])
        ids, labels, mask = (batch[k].to(device) for k in ("input_ids", "labels", "attention_mask"))
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)),
                                                 shift_labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        total += float(loss)
        count += int((shift_labels != IGNORE_INDEX).sum())
    return total / max(count, 1)


def _generate(model, tokenizer, prompts: list[str], cfg: FinetuneConfig, device) -> tuple[list[str], float]:
    import torch

    outputs = []
    started = time.perf_counter()
    tokenizer.padding_side = "left"  # generation continues from the right edge
    for start in range(0, len(prompts), cfg.eval.batch_size):
        batch = tokenizer(prompts[start:start + cfg.eval.batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=cfg.eval.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        outputs += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return outputs, time.perf_counter() - started


def _evaluate(job: dict) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = FinetuneConfig.model_validate(job["config"])
    plan = Plan.model_validate(job["plan"])
    data_path, adapter_path = Path(job["data"]), Path(job["adapter"])
    device = torch.device("cuda:0" if plan.device == "cuda" and torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(adapter_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    base = AutoModelForCausalLM.from_pretrained(job["base"], device_map={"": str(device)},
                                                dtype=torch_dtype(plan.compute_dtype),
                                                attn_implementation=plan.eval_attn)
    model = PeftModel.from_pretrained(base, adapter_path).eval()
    print(f"evaluating on {device} with attn_implementation={model.config._attn_implementation}", flush=True)

    dataset = load_split(data_path, "eval")
    prompts_file = data_path / "eval_prompts.jsonl"
    pairs = [json.loads(line) for line in prompts_file.read_text().splitlines()][: cfg.eval.max_samples]
    prompts, references = [p["prompt"] for p in pairs], [p["reference"] for p in pairs]

    scores, answers = {}, {}
    for name in ("base", "adapter"):
        if name == "base":
            model.base_model.disable_adapter_layers()
        else:
            model.base_model.enable_adapter_layers()
        loss = _loss(model, dataset, cfg.eval.batch_size, tokenizer.pad_token_id, device)
        generated, seconds = _generate(model, tokenizer, prompts, cfg, device) if prompts else ([], 0.0)
        hits = [score_answer(g, r, cfg.eval.metric) for g, r in zip(generated, references)]
        answers[name] = generated
        scores[name] = dict(loss=loss, perplexity=math.exp(min(loss, 50)),
                            generation_score=(sum(hits) / len(hits)) if hits else None, generated=len(generated),
                            generate_seconds=round(seconds, 2))
        print(f"{name}: loss {loss:.4f}, {cfg.eval.metric} {scores[name]['generation_score']}", flush=True)
    samples = [dict(prompt=p[-200:], reference=r, base=b, adapter=a)
               for p, r, b, a in list(zip(prompts, references, answers["base"], answers["adapter"]))[:5]]
    out = Path(job["out"])
    report = dict(base=scores["base"], adapter=scores["adapter"], metric=cfg.eval.metric,
                  attn_implementation=model.config._attn_implementation, device=str(device),
                  eval_rows=len(dataset), samples=samples, path=str(out), references=references, predictions=answers)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


# ---------------------------------------------------------------- orchestrator side


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
                        base=str(base.path), data=str(data.path), adapter=str(adapter_path), out=str(out))
        run_worker("evaluate", python_module("tasks.evaluate", job), gpus.env, out.parent)

    produce_on_devices(out, gpus.ids, launch)
    report = EvalReport.model_validate_json(out.read_text())
    run_logger().info("eval (%s): base %s=%s loss=%.4f | adapter %s=%s loss=%.4f", report.attn_implementation,
                      report.metric, report.base.generation_score, report.base.loss, report.metric,
                      report.adapter.generation_score, report.adapter.loss)
    return report


if __name__ == "__main__":
    worker_main(_evaluate)
