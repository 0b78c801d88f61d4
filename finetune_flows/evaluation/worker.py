"""Evaluation worker body: `python -m finetune_flows.evaluation.worker job.json` on the selected GPUs (or the CPU).

Scores base and base + adapter (one model, the adapter switched off and on), or base and a merged checkpoint
(two plain models, loaded one after the other): loss/perplexity on the answer tokens and a generation metric from
greedy decoding. With the `static`/`continuous` engines the base is the dequantized evaluation copy of the 4-bit
base (models/dequantize.py), placed on one GPU or, when it does not fit one, spread over the selected GPUs; with
`generate` it is the 4-bit model. A merged checkpoint loads the same way, in the same dtype. The
orchestrator side is `finetune_flows/evaluation/evaluate.py`; the engines are in `generation.py` and `static_engine.py`.
"""

from __future__ import annotations

import gc
import json
import math
import os
from pathlib import Path

from finetune_flows.files import write_json
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.data.dataset import IGNORE_INDEX, load_split
from finetune_flows.models.dequantize import dequantized_copy
from finetune_flows.config.plan import Plan
from finetune_flows.evaluation.generation import (
    Generation, choose_engine, generate_continuous, generate_reference, kv_bytes_per_token, stop_token_ids,
)
from finetune_flows.evaluation.static_engine import generate_static, length_sorted_batches, plain_cache
from finetune_flows.models.kernels import apply_kernels
from finetune_flows.runtime.gpus import cap_process_memory, free_bytes
from finetune_flows.runtime.lifecycle import worker_main
from finetune_flows.evaluation.metrics import score_answer
from finetune_flows.models.quantize import QuantizedModel, torch_dtype
from finetune_flows.models.shapes import config_shape
from finetune_flows.data.packing import PadCollator


def padded_loss(model, dataset, batch_size: int, pad_id: int, device) -> float:
    """The reference loss pass (engine `generate`): right-padded batches in order, logits at every position."""
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


def answer_loss(model, dataset, batch_tokens: int, pad_id: int, device) -> tuple[float, int]:
    """Summed cross-entropy over the answer tokens and their count, computing only what it needs.

    Rows are sorted by length into batches of about `batch_tokens` padded tokens and left-padded, so every row
    ends in the same column and the answers sit in the last columns; the model is asked for logits of those
    columns only (`logits_to_keep`) instead of a vocabulary-sized row for every prompt token. (Packing rows into
    one sequence would avoid padding altogether, but with sdpa/eager every packed row then attends over the
    whole pack; sorting leaves little padding without that cost.)
    """
    import torch

    total, count = 0.0, 0
    for batch in length_sorted_batches([len(r["input_ids"]) for r in dataset], 0, batch_tokens):
        rows = [dataset[i] for i in batch]
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[r, width - n:], labels[r, width - n:], mask[r, width - n:] = (
                torch.tensor(row["input_ids"]), torch.tensor(row["labels"]), 1)
        targets = labels[:, 1:]
        scored = (targets != IGNORE_INDEX).any(0).nonzero()
        if not len(scored):
            continue
        keep = width - int(scored[0])  # logits of positions first..width-1 predict targets first+1..width
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        columns = torch.arange(width - keep, width, device=device)  # an index, not a slice: see last_position
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                           logits_to_keep=columns, use_cache=False).logits[:, :-1].float()
        wanted = targets[:, width - keep:].to(logits.device)
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), wanted.reshape(-1),
                                                         ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((wanted != IGNORE_INDEX).sum())
    return total, count


def shared_answers(dataset, prompt_ids: list[list[int]]) -> tuple[list, list]:
    """Per prompt, the eval row that is exactly that prompt followed by its scored answer, as (answer ids,
    labels), so the static engine scores the answer from the prompt's cache while generating; and the rows left
    for the separate loss pass (multi-turn rows, rows beyond eval.max_samples, prompts tokenized differently)."""
    slots: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        slots.setdefault(tuple(p), []).append(i)
    answers: list = [None] * len(prompt_ids)
    rest = []
    for row in dataset:
        labels = row["labels"]
        first = next((j for j, label in enumerate(labels) if label != IGNORE_INDEX), 0)
        matches = slots.get(tuple(row["input_ids"][:first])) if first else None
        if matches:
            answers[matches.pop(0)] = (row["input_ids"][first:], labels[first:])
        else:
            rest.append(row)
    return answers, rest


def loss_split(engine: str, model, dataset, prompt_ids: list[list[int]]) -> tuple[list, list]:
    """(the answers the engine scores while generating, the rows left for the loss pass): `shared_answers` for the
    static engine where the model's static cache keeps every prompt whole (not with sliding-window layers), else
    every row goes to the loss pass."""
    if engine == "static" and plain_cache(model):
        return shared_answers(dataset, prompt_ids)
    return [None] * len(prompt_ids), dataset


def placement(copy: Path, device) -> dict:
    """device_map for the evaluation copy: one device when it fits in half of GPU 0's free memory (the rest is
    for the KV cache and activations), else every visible (selected) GPU with a per-GPU memory limit."""
    import torch

    if device.type != "cuda" or torch.cuda.device_count() == 1:
        return {"device_map": {"": str(device)}}
    size = sum(p.stat().st_size for p in copy.glob("*.safetensors"))
    free = [free_bytes(i) for i in range(torch.cuda.device_count())]
    if size <= 0.5 * free[0]:
        return {"device_map": {"": str(device)}}
    return {"device_map": "auto", "max_memory": {i: int(f * 0.8) for i, f in enumerate(free)}}


def auto_batch_tokens(model, device) -> int:
    """Padded tokens per forward: what fits in half of the model's (first) GPU's free memory (few large batches
    mean few decode steps, and a GPU decode step of a small model costs about the same for 10 sequences as for
    500), or on the CPU at most 16,384 (there a batch whose cache stays in the processor caches is faster)."""
    import torch

    shape = config_shape(model.config)
    dtype_bytes = torch.finfo(model.dtype).bits // 8
    per_token = kv_bytes_per_token(model.config, dtype_bytes) + \
        (6 * shape["hidden_size"] + 3 * shape["intermediate_size"]) * dtype_bytes
    if device.type == "cuda":
        budget = 0.5 * free_bytes(device.index or 0)
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(0.25 * available, 4 * 2**30)
    return int(max(4096, min(2**18 if device.type == "cuda" else 2**14, budget // per_token)))


def _load_plain(path: Path, dtype, plan: Plan, device, remote: bool, engine: str):
    """A plain (or 4-bit) checkpoint: on one device for `generate`, placed as the copy would be otherwise."""
    from transformers import AutoModelForCausalLM

    where = {"device_map": {"": str(device)}} if engine == "generate" else placement(path, device)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=plan.eval_attn,
                                                trust_remote_code=remote, **where).eval()


def _load_base(cfg: FinetuneConfig, base: QuantizedModel, plan: Plan, device, engine: str):
    """The base as evaluation scores it: the 4-bit model for `generate`, else its dequantized copy."""
    if engine == "generate":
        return _load_plain(base.path, torch_dtype(plan.compute_dtype), plan, device, cfg.model.trust_remote_code,
                           engine)
    copy = dequantized_copy(base, cfg.cache_root, str(device), cfg.model.trust_remote_code)
    return _load_plain(copy, torch_dtype(plan.eval_dtype or plan.compute_dtype), plan, device,
                       cfg.model.trust_remote_code, engine)


def _load_with_adapter(cfg: FinetuneConfig, base: QuantizedModel, adapter_path: Path, plan: Plan, device,
                       engine: str):
    from peft import PeftModel

    model = PeftModel.from_pretrained(_load_base(cfg, base, plan, device, engine), adapter_path).eval()
    dtype = torch_dtype(plan.eval_dtype or plan.compute_dtype)
    if engine != "generate":
        # PEFT keeps adapter weights in fp32, so every adapted layer of a bf16 evaluation copy would cast its input
        # to fp32 and run the adapter's matmuls in fp32, which costs about as much as the layer itself. The adapter
        # runs in the copy's dtype instead.
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.data = param.data.to(dtype)
    return model


def _load_merged(cfg: FinetuneConfig, checkpoint: Path, plan: Plan, device, engine: str):
    """A merged checkpoint in the dtype the base is scored in, so the two rows differ only by the weights."""
    dtype = torch_dtype(plan.compute_dtype if engine == "generate" else plan.eval_dtype or plan.compute_dtype)
    return _load_plain(checkpoint, dtype, plan, device, cfg.model.trust_remote_code, engine)


def _models(job: dict, cfg: FinetuneConfig, base: QuantizedModel, plan: Plan, device, engine: str):
    """(name, model) in scoring order. Base and base + adapter are one model with the adapter switched off, then
    on; for a merged checkpoint the base is released before the checkpoint loads (the caller drops its reference
    first), so only one model is ever in memory."""
    if job.get("adapter"):
        model = _load_with_adapter(cfg, base, Path(job["adapter"]), plan, device, engine)
        model.base_model.disable_adapter_layers()
        yield "base", model
        model.base_model.enable_adapter_layers()
        yield "adapter", model
    else:
        yield "base", _load_base(cfg, base, plan, device, engine)
        yield "merged", _load_merged(cfg, Path(job["checkpoint"]), plan, device, engine)


def _devices(model, device) -> set[str]:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {str(d) for d in (getattr(inner, "hf_device_map", None) or {"": device}).values()}


def eval_device(plan: Plan, budget_gib: float | None):
    """The first selected GPU (or the CPU), with every selected GPU capped at `hardware.memory_budget_gib`: the
    evaluation copy may be spread over them (placement)."""
    import torch

    if plan.device != "cuda" or not torch.cuda.is_available():
        return torch.device("cpu")
    for index in range(torch.cuda.device_count()):
        cap_process_memory(budget_gib, index)
    return torch.device("cuda:0")


def _evaluate(job: dict) -> dict:
    from transformers import AutoTokenizer

    cfg = FinetuneConfig.model_validate(job["config"])
    plan = Plan.model_validate(job["plan"])
    base = QuantizedModel.model_validate(job["base_model"])
    data_path = Path(job["data"])
    device = eval_device(plan, cfg.hardware.memory_budget_gib)
    remote = cfg.model.trust_remote_code  # the orchestrator refused it unless the worker's policy allows it
    # The tokenizer saved with the adapter or checkpoint: the one it was trained (and merged) with.
    tokenizer = AutoTokenizer.from_pretrained(job.get("adapter") or job["checkpoint"], trust_remote_code=remote)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    requested = choose_engine(plan.eval_engine, plan.eval_attn)  # refuses before anything loads

    dataset = load_split(data_path, "eval")
    pairs = [json.loads(line) for line in (data_path / "eval_prompts.jsonl").read_text().splitlines()]
    pairs = pairs[: cfg.eval.max_samples]
    prompts, references = [p["prompt"] for p in pairs], [p["reference"] for p in pairs]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    long_references = sum(len(tokenizer(r.strip(), add_special_tokens=False)["input_ids"]) > cfg.eval.max_new_tokens
                          for r in references)
    if long_references:
        print(f"warning: {long_references} of {len(references)} references are longer than eval.max_new_tokens="
              f"{cfg.eval.max_new_tokens} tokens: those answers are cut before they can match; raise "
              "eval.max_new_tokens", flush=True)

    scores, answers, kernelized, model = {}, {}, {}, None
    models = _models(job, cfg, base, plan, device, requested)
    while True:
        model = None  # a merged checkpoint loads only after the base has left memory
        gc.collect()
        try:
            name, model = next(models)
        except StopIteration:
            break
        devices = _devices(model, device)
        engine = requested if requested == "generate" else choose_engine(plan.eval_engine, plan.eval_attn,
                                                                          len(devices))
        kernelized.update(apply_kernels(model, cfg.hardware.kernels)["kernelized"])
        batch_tokens = cfg.eval.batch_tokens or auto_batch_tokens(model, device)
        print(f"{name}: evaluating on {device} with attn_implementation={model.config._attn_implementation}, "
              f"engine {engine}" + ("" if engine == "generate" else f" in {model.dtype}, {batch_tokens} tokens per "
                                    "batch"), flush=True)
        shared, rest = loss_split(engine, model, dataset, prompt_ids)
        gen = _generate(engine, model, tokenizer, prompts, prompt_ids, cfg, batch_tokens, devices, shared, device)
        if gen.failures:
            raise RuntimeError(f"{engine} engine: {len(gen.failures)} of {len(prompts)} prompts failed: "
                               + "; ".join(gen.failures[:5]))
        if engine == "generate":
            loss = padded_loss(model, dataset, cfg.eval.batch_size, tokenizer.pad_token_id, device)
        else:  # the rows the static engine scored while generating, plus a loss pass over the others
            total, count = answer_loss(model, rest, batch_tokens, tokenizer.pad_token_id, device)
            shared_loss, shared_count = gen.details.get("loss", (0.0, 0))
            loss = (total + shared_loss) / max(count + shared_count, 1)
        # batch_decode([]) gives [''], one answer to no prompt
        generated = tokenizer.batch_decode(gen.tokens, skip_special_tokens=True) if gen.tokens else []
        hits = [score_answer(g, r, cfg.eval.metric) for g, r in zip(generated, references)]
        answers[name] = generated
        new_tokens = sum(map(len, gen.tokens))
        scores[name] = dict(loss=loss, perplexity=math.exp(min(loss, 50)),
                            generation_score=(sum(hits) / len(hits)) if hits else None, generated=len(generated),
                            generate_seconds=round(gen.seconds, 3),
                            first_result_seconds=round(gen.first_result_seconds, 3), generated_tokens=new_tokens)
        print(f"{name}: loss {loss:.4f}, {cfg.eval.metric} {scores[name]['generation_score']}, {len(generated)} "
              f"answers in {gen.seconds:.2f} s ({new_tokens / max(gen.seconds, 1e-9):.0f} tokens/s)", flush=True)
        dtype, attn = str(model.dtype).removeprefix("torch."), model.config._attn_implementation
    samples = [dict(prompt=p[-200:], reference=r, **{name: a[i] for name, a in answers.items()})
               for i, (p, r) in enumerate(list(zip(prompts, references))[:5])]
    out = Path(job["out"])
    report = dict(**scores, metric=cfg.eval.metric, engine=engine, dtype=dtype, kernelized=kernelized,
                  attn_implementation=attn, device=str(device), eval_rows=len(dataset), samples=samples,
                  path=str(out), references=references, predictions=answers, long_references=long_references,
                  max_new_tokens=cfg.eval.max_new_tokens)
    write_json(out, report)
    return report


def _generate(engine: str, model, tokenizer, prompts: list[str], prompt_ids: list[list[int]], cfg: FinetuneConfig,
              batch_tokens: int, devices: set[str], shared: list, device) -> Generation:
    if not prompts:
        return Generation([], 0.0, 0.0)
    if engine == "generate":
        return generate_reference(model, tokenizer, prompts, cfg.eval.max_new_tokens, cfg.eval.batch_size)
    stops = stop_token_ids(model, tokenizer)
    if engine == "continuous":
        memory = int(0.6 * free_bytes(device.index or 0)) if device.type == "cuda" else 2**30
        return generate_continuous(model, prompt_ids, cfg.eval.max_new_tokens, stops, tokenizer.pad_token_id,
                                   batch_tokens, memory)
    return generate_static(model, prompt_ids, cfg.eval.max_new_tokens, stops, tokenizer.pad_token_id, batch_tokens,
                           cuda_graphs=None if len(devices) == 1 else False, answers=shared)


if __name__ == "__main__":
    worker_main(_evaluate)
