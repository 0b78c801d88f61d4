"""Ship it: the adapter merged into the exact base it was trained on, as one standalone checkpoint.

The adapter learned against the 4-bit weights, so the merge target is those weights dequantized (the
`finetune_flows/models/dequantize.py` copy), not the original full-precision checkpoint. The worker
(`python -m finetune_flows.export.merge job.json`, on the first selected GPU or the CPU):

1. scores held-out prompts with the 4-bit base + adapter, as evaluation does: the reference logits;
2. dequantizes the 4-bit base, merges the adapter into it (peft `merge_and_unload`), casts to `export.dtype`
   and saves the checkpoint with its tokenizer;
3. reloads that checkpoint with plain `AutoModelForCausalLM.from_pretrained`, as a user would, and checks its
   logits against the reference: the largest difference relative to the reference's spread must stay within
   `export.max_logit_error`, or the export fails and nothing is kept.

The checkpoint is content-addressed in the cache (`<cache>/merged/<fingerprint>`) and hard-linked into
`<run>/merged/` with a model card (model_card.py). When the device lacks the memory for the merged model (within
`hardware.memory_budget_gib` where set), the finetune flow skips the step and says so; `flows/export.py` refuses
with the numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import psutil
from pydantic import BaseModel

from finetune_flows.files import write_json
from finetune_flows.orchestration.concurrency import device_slots
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.data.dataset import PreparedDataset
from finetune_flows.config.plan import Plan, worker_config
from finetune_flows.errors import ConfigError, EnvironmentMismatch
from finetune_flows.store.fingerprint import combine, hash_tree, step_versions
from finetune_flows.runtime.gpus import GpuSelection, cap_process_memory, free_bytes
from finetune_flows.runtime.launcher import python_module, run_worker, write_job
from finetune_flows.logs import run_logger
from finetune_flows.runtime.lifecycle import worker_main
from finetune_flows.models.quantize import QuantizedModel, torch_dtype
from finetune_flows.store.entries import MANIFEST, Entry, reuse_or_produce, step_state
from finetune_flows.models.dequantize import dequantize_model
from finetune_flows.training.planner import GIB, allocator_bytes
from finetune_flows.training.sharding import readable_model_shape

RECORD = "export.json"
HEADROOM = 1.25  # allocator slack, activations of the check, the tokenizer: measured need is below this


class MergedModel(BaseModel):
    path: Path  # the content-addressed checkpoint in the cache
    fingerprint: str
    dtype: str
    parameters: int
    size_mb: float
    logit_error: float  # max |merged - (base + adapter)| / std(base + adapter logits) on the check prompts
    top1_agreement: float  # share of positions where both predict the same next token
    check_prompts: int
    check_tokens: int
    device: str
    seconds: float


class _Skipped(Exception):
    """The worker found the merged model does not fit this device: nothing to store."""


class ExportResult(MergedModel):
    """The merged checkpoint as placed in a run directory (`<run>/merged/`, with its model card)."""

    cache_path: Path

    def is_complete(self) -> bool:
        return (self.path / "config.json").is_file()


def merge_fingerprint(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter: Path,
                      plan: Plan) -> str:
    return combine(base.fingerprint, hash_tree(adapter), data.fingerprint, cfg.export.fingerprint(), plan.device,
                   plan.compute_dtype, step_versions("merge-adapter"))


# ---------------------------------------------------------------- worker side


def check_bytes(parameters: int, compute_bytes: int) -> float:
    """GPU memory the check needs: the merged model in the compute dtype, with HEADROOM."""
    return parameters * compute_bytes * HEADROOM


def budget_skips_merge(cfg: FinetuneConfig, plan: Plan) -> str | None:
    """Why the check will not fit within `hardware.memory_budget_gib` (so the finetune flow will skip the merge), from
    the model's shape before anything loads; None where it fits, or where the shape cannot be read yet."""
    budget, shape = cfg.hardware.memory_budget_gib, readable_model_shape(cfg.model.source, cfg.model.trust_remote_code)
    if budget is None or plan.device != "cuda" or not cfg.export.merge or shape is None:
        return None
    need = check_bytes(shape.linear_params + shape.embedding_params, 4 if plan.compute_dtype == "float32" else 2)
    if need <= allocator_bytes(budget):
        return None
    return (f"export.merge: checking the merged model needs about {need / GIB:.1f} GiB of GPU memory, more than "
            f"hardware.memory_budget_gib={budget:g} leaves the allocator ({allocator_bytes(budget) / GIB:.1f} GiB), "
            "so this run will skip the merge; set export.merge=false to leave it out, or merge later with "
            "flows/export.py and a larger budget")


def memory_shortfalls(parameters: int, export_bytes: int, compute_bytes: int, host_free: int, gpu: str | None,
                      budget_gib: float | None) -> list[str]:
    """What the merge lacks, one line per memory: host memory (`host_free` available) holds the merged weights in the
    export dtype beside the dequantized ones; the GPU (`gpu`, its name; None: the CPU) the merged model in the compute
    dtype for the check, within `hardware.memory_budget_gib` where one is set (the caller has capped the allocator
    there)."""
    needs = {"host memory": (parameters * (export_bytes + compute_bytes) * HEADROOM, host_free)}
    if gpu is not None:
        name = gpu if budget_gib is None else f"{gpu} within hardware.memory_budget_gib={budget_gib:g}"
        needs[name] = (check_bytes(parameters, compute_bytes), free_bytes(0))
    return [f"{name}: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
            for name, (need, free) in needs.items() if need > free]


def _parameter_count(base_path: Path, trust_remote_code: bool) -> int:
    """Parameters of the full-precision model, from its config on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_path, trust_remote_code=trust_remote_code)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def _check_inputs(data_path: Path, count: int, tokenizer) -> list[list[int]]:
    """Token ids the merge is checked on: held-out prompts with their reference answers appended (what the adapter
    was trained for), or, for text data (no prompts), the held-out rows as the dataset step tokenized them."""
    rows = [json.loads(line) for line in (data_path / "eval_prompts.jsonl").read_text().splitlines()]
    if rows:
        return [tokenizer(r["prompt"] + r["reference"], add_special_tokens=False).input_ids for r in rows[:count]]
    import pyarrow.parquet as pq

    return [list(ids) for ids in pq.read_table(data_path / "eval.parquet", columns=["input_ids"])
            .column("input_ids").to_pylist()[:count]]


def _logits(model, inputs: list[list[int]], device):
    import torch

    out = []
    with torch.no_grad():
        for ids in inputs:
            out.append(model(input_ids=torch.tensor([ids], device=device)).logits[0].float().cpu())
    return out


def compare_logits(reference: list, candidate: list) -> tuple[float, float, int]:
    """(max |candidate - reference| / std(reference), top-1 agreement, tokens compared)."""
    import torch

    ref, cand = torch.cat(reference), torch.cat(candidate)
    error = float((cand - ref).abs().max() / ref.std().clamp_min(1e-12))
    agreement = float((cand.argmax(-1) == ref.argmax(-1)).float().mean())
    return error, agreement, ref.shape[0]


def _export(job: dict) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = FinetuneConfig.model_validate(job["config"])
    plan = Plan.model_validate(job["plan"])
    base_path, adapter, out = Path(job["base"]), Path(job["adapter"]), Path(job["out"])
    device = torch.device("cuda:0" if plan.device == "cuda" and torch.cuda.is_available() else "cpu")
    compute, export_dtype = torch_dtype(plan.compute_dtype), torch_dtype(cfg.export.dtype)
    started = time.perf_counter()

    remote = cfg.model.trust_remote_code
    parameters = _parameter_count(base_path, remote)
    # The merge happens in host memory (the GPU holds only the 4-bit model); the check then loads the merged
    # model on the device in the compute dtype, within the run's memory budget as every GPU worker is.
    budget = cfg.hardware.memory_budget_gib if device.type == "cuda" else None
    cap_process_memory(budget, 0)  # no cap without a budget (and on the CPU)
    short = memory_shortfalls(parameters, export_dtype.itemsize, compute.itemsize,
                              psutil.virtual_memory().available,  # MemAvailable
                              torch.cuda.get_device_name(device) if device.type == "cuda" else None, budget)
    if short:
        reason = (f"merging {parameters / 1e6:.0f}M parameters into a {cfg.export.dtype} checkpoint does not fit: "
                  + "; ".join(short))
        if job["required"]:
            raise EnvironmentMismatch([reason], "export")
        return {"skipped": reason}

    tokenizer = AutoTokenizer.from_pretrained(adapter, trust_remote_code=remote)
    inputs = _check_inputs(Path(job["data"]), cfg.export.check_prompts, tokenizer)
    load = dict(device_map={"": str(device)}, dtype=compute, trust_remote_code=remote)

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, **load), adapter).eval()
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            # bitsandbytes' CPU inference shortcut (AVX512-BF16) repacks the 4-bit weight and rounds to bf16;
            # training (and the GPU) multiply by the dequantized weight, the one the adapter learned against.
            module.support_avx512bf16_for_cpu = False
    reference = _logits(model, inputs, device)
    del model

    base = AutoModelForCausalLM.from_pretrained(base_path, **load)
    layers = dequantize_model(base, offload_to_cpu=device.type == "cuda")
    base.hf_device_map = {"": "cpu"}  # offloaded: the adapter must load next to the weights, not on the GPU
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload().to(export_dtype)
    merged.config.use_cache = True
    # every weight is in this process's memory now; the map above would make save_pretrained warn of offloaded
    # modules ("ensure that unallocated cpu memory exceeds the shard_size (50GB default)") on every merge
    del merged.hf_device_map
    # The orchestrator holds the entry's lock and commits its manifest; a merge that fails its check keeps nothing.
    try:
        merged.save_pretrained(out)
        tokenizer.save_pretrained(out)
        del merged, base
        reloaded = AutoModelForCausalLM.from_pretrained(out, **load).eval()  # what a user gets
        error, agreement, tokens = compare_logits(reference, _logits(reloaded, inputs, device))
        print(f"merged {layers} dequantized layers + adapter -> {cfg.export.dtype}: logits within {error:.3g} "
              f"(relative to their spread) of base + adapter, top-1 agreement {agreement:.4f} on {tokens} tokens",
              flush=True)
        if not error <= cfg.export.max_logit_error:  # the same inputs give the same result: not worth a retry
            raise ConfigError([f"the merged model's logits differ from base + adapter by {error:.3g} of their "
                               f"spread, more than export.max_logit_error={cfg.export.max_logit_error}: not "
                               "exported (export.merge=false skips the step)"], "export")
        record = dict(path=str(out), fingerprint=job["fingerprint"], dtype=cfg.export.dtype, parameters=parameters,
                      size_mb=round(sum(p.stat().st_size for p in out.glob("*.safetensors")) / 2**20, 1),
                      logit_error=error, top1_agreement=agreement, check_prompts=len(inputs),
                      check_tokens=tokens, device=str(device), seconds=round(time.perf_counter() - started, 1))
        write_json(out / RECORD, record)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return record


# ---------------------------------------------------------------- orchestrator side


def merge_adapter(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter: Path, plan: Plan,
                  gpus: GpuSelection, required: bool = False) -> MergedModel | None:
    """The merged checkpoint (a store entry per base, adapter and export settings; a reused one as a `Cached`
    state), or None when it does not fit (`required`: raise instead)."""
    entry = Entry(cfg.cache_root, "merged", merge_fingerprint(cfg, data, base, adapter, plan))
    out = entry.path

    def produce() -> MergedModel:
        job = write_job(out.parent / f".{entry.key}.work", "export",
                        config=worker_config(cfg, plan, gpus.ids, data.format), plan=plan.model_dump(mode="json"),
                        base=str(base.path), adapter=str(adapter), data=str(data.path), out=str(out),
                        fingerprint=entry.key, required=required)
        try:
            with device_slots(gpus.ids):  # lock order: the entry's lock (held by the caller), then the device
                outcome = run_worker("export", python_module("finetune_flows.export.merge", job), gpus.env, job.parent)
        except BaseException:
            entry.invalidate()  # a merge that failed its check keeps nothing
            raise
        if "skipped" in outcome:
            raise _Skipped(outcome["skipped"])
        return MergedModel.model_validate_json((out / RECORD).read_text())

    try:
        merged, reused = reuse_or_produce(entry, MergedModel, produce, outputs=["."])
    except _Skipped as skipped:
        run_logger().info("merged checkpoint skipped: %s (flows/export.py can merge on a bigger machine)", skipped)
        return None
    run_logger().info("merged checkpoint: %s (%s, %.0f MiB), logits within %.3g of base + adapter", merged.path,
                      merged.dtype, merged.size_mb, merged.logit_error)
    return step_state(merged, reused, entry)


WEIGHTS = (".safetensors", ".bin")


def link_tree(source: Path, target: Path) -> None:
    """A run's copy of a cached checkpoint: the weights hard-linked (no space; made read-only, since a write into
    a link would change every run's copy and the cache's), copied where the file system has no links; every other
    file (config, tokenizer, generation settings: what users edit and transformers rewrites in place) copied."""
    target.mkdir(parents=True)
    entry = Entry(source.parent.parent, source.parent.name, source.name)  # the link and chmod keep it verified
    for path in source.iterdir():
        if not path.is_file() or path.name in (RECORD, MANIFEST):
            continue
        if path.suffix in WEIGHTS:
            def link(path: Path = path) -> None:
                path.chmod(0o444)
                os.link(path, target / path.name)

            try:
                entry.keep_verified(path.name, link)
                continue
            except OSError:
                pass
        shutil.copy2(path, target / path.name)


if __name__ == "__main__":
    worker_main(_export)
