"""Evaluation worker body: `python -m tasks.eval_worker job.json` on the first selected GPU (or the CPU).

Scores base and base + adapter (one model, the adapter switched off and on): loss/perplexity on the answer
tokens and a generation metric from greedy decoding. The orchestrator side is `tasks/evaluate.py`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from tasks.config import FinetuneConfig
from tasks.dataset import IGNORE_INDEX, load_split
from tasks.environment import Plan
from tasks.launcher import worker_main
from tasks.metrics import score_answer
from tasks.quantize import torch_dtype
from tasks.train_worker import PadCollator

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
    remote = cfg.model.trust_remote_code  # the orchestrator refused it unless the worker's policy allows it
    tokenizer = AutoTokenizer.from_pretrained(adapter_path, trust_remote_code=remote)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    base = AutoModelForCausalLM.from_pretrained(job["base"], device_map={"": str(device)},
                                                dtype=torch_dtype(plan.compute_dtype),
                                                attn_implementation=plan.eval_attn, trust_remote_code=remote)
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


if __name__ == "__main__":
    worker_main(_evaluate)
