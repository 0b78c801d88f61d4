"""Step 4: load the base model in 4-bit (bitsandbytes NF4, double quantization) and keep that checkpoint.

Quantizing once and saving the 4-bit weights means training ranks, evaluation and retries load ~4x fewer bytes
and skip re-quantization. A store entry keyed on the model's identity (revision included), the quantization
settings, the compute dtype, the device, library versions and code.
"""

from __future__ import annotations

import time
from pathlib import Path

from typing import Any

from pydantic import BaseModel

from finetune_flows.errors import ModelSourceError
from finetune_flows.files import write_json
from finetune_flows.orchestration.concurrency import device_slots
from finetune_flows.config.schema import FinetuneConfig, QuantizationConfig
from finetune_flows.config.plan import Plan, worker_config
from finetune_flows.store.fingerprint import combine, step_versions
from finetune_flows.runtime.gpus import GpuSelection, cap_process_memory
from finetune_flows.runtime.launcher import python_module, run_worker, write_job
from finetune_flows.logs import run_logger
from finetune_flows.runtime.lifecycle import worker_main
from finetune_flows.models.sources import materialize_model, model_identity
from finetune_flows.training.sharding import quant_storage
from finetune_flows.store.entries import Entry, StoreError, reuse_or_produce, step_state


class QuantizedModel(BaseModel):
    path: Path  # a checkpoint that from_pretrained loads as 4-bit (or the plain checkpoint without 4-bit)
    fingerprint: str
    load_in_4bit: bool
    compute_dtype: str
    memory_footprint_mb: float
    linear4bit_layers: int
    quantize_seconds: float
    quant_storage: str = "uint8"  # the dtype the packed 4-bit weights are stored in (the compute dtype under fsdp)


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def bnb_config(q: QuantizationConfig, compute_dtype: str, storage: str = "uint8"):
    """The single place that builds the BitsAndBytesConfig. `storage`: the dtype of the tensors holding the packed
    4-bit weights (the compute dtype when FSDP shards them: finetune_flows/training/sharding.py)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=q.quant_type, bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(compute_dtype),
        bnb_4bit_quant_storage=torch.uint8 if storage == "uint8" else torch_dtype(storage),
    )


def count_4bit_layers(model) -> int:
    import bitsandbytes as bnb

    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def quantize_key_parts(cfg: FinetuneConfig, plan: Plan) -> dict[str, Any]:
    """Everything the 4-bit checkpoint depends on (the README's cache-key table lists the same)."""
    return {"model": model_identity(cfg.model.source, cfg.model.revision),
            "trust_remote_code": cfg.model.trust_remote_code,
            "quantization": cfg.quantization.model_dump(mode="json"), "compute_dtype": plan.compute_dtype,
            "quant_storage": quant_storage(plan.strategy, plan.compute_dtype), "device": plan.device,
            **step_versions("quantize-base-model")}


def quantize_fingerprint(cfg: FinetuneConfig, plan: Plan) -> str:
    return combine(quantize_key_parts(cfg, plan))


def _quantize(job: dict) -> dict:
    """Worker body: runs in a child process that sees only the selected GPUs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = FinetuneConfig.model_validate(job["config"])
    compute_dtype, out = job["compute_dtype"], Path(job["out"])
    storage = job.get("quant_storage", "uint8")
    src = materialize_model(cfg.model.source, cfg.cache_root, cfg.model.revision, cfg.model.trust_remote_code)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if device != "cpu":  # within the run's memory budget, as every GPU worker (the output does not depend on it)
        cap_process_memory(cfg.hardware.memory_budget_gib, 0)
    started = time.perf_counter()
    remote = cfg.model.trust_remote_code
    model, loading = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=bnb_config(cfg.quantization, compute_dtype, storage), device_map={"": device},
        dtype=torch_dtype(compute_dtype), revision=cfg.model.revision, trust_remote_code=remote,
        output_loading_info=True,
    )
    if loading["missing_keys"]:  # transformers initializes them at random and says so in a table only
        missing = sorted(loading["missing_keys"])
        raise ModelSourceError(f"model.source={cfg.model.source}: the checkpoint lacks {len(missing)} weight(s) its "
                               f"config.json's model has, e.g. {', '.join(missing[:3])}; transformers would start "
                               "them at random (a config.json of another model, or tie_word_embeddings changed?)")
    layers = count_4bit_layers(model)
    first = next(m for m in model.modules() if type(m).__name__ == "Linear4bit")
    print(f"quantized {layers} linear layers to 4-bit {cfg.quantization.quant_type} on {first.weight.device} "
          f"(compute {compute_dtype}, stored as {storage}); footprint {model.get_memory_footprint() / 2**20:.1f} MiB",
          flush=True)
    # The orchestrator holds the entry's lock and commits its manifest after this process exits.
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src, revision=cfg.model.revision, trust_remote_code=remote).save_pretrained(out)
    result = dict(path=str(out), fingerprint=job["fingerprint"], load_in_4bit=True, compute_dtype=compute_dtype,
                  memory_footprint_mb=round(model.get_memory_footprint() / 2**20, 2), linear4bit_layers=layers,
                  quantize_seconds=round(time.perf_counter() - started, 2), device=str(first.weight.device),
                  quant_storage=storage)
    write_json(out / "quantization.json", result)  # last: marks the 4-bit base complete
    return result


def quantize_base_model(cfg: FinetuneConfig, plan: Plan, gpus: GpuSelection, run_dir: Path):
    """Reuse the verified 4-bit checkpoint, or quantize it under the entry's lock; report its memory footprint."""
    fingerprint = quantize_fingerprint(cfg, plan)
    if not cfg.quantization.load_in_4bit:  # nothing to produce: training loads the plain checkpoint
        path = materialize_model(cfg.model.source, cfg.cache_root, cfg.model.revision, cfg.model.trust_remote_code)
        return QuantizedModel(path=path, fingerprint=fingerprint, load_in_4bit=False, compute_dtype=plan.compute_dtype,
                              memory_footprint_mb=0.0, linear4bit_layers=0, quantize_seconds=0.0)
    entry = Entry(cfg.cache_root, "quantized", fingerprint)

    def produce() -> QuantizedModel:
        job = write_job(run_dir / "work", "quantize", config=worker_config(cfg, plan, gpus.ids), out=str(entry.path),
                        compute_dtype=plan.compute_dtype, fingerprint=fingerprint,
                        quant_storage=quant_storage(plan.strategy, plan.compute_dtype))
        with device_slots(gpus.ids):  # lock order: the entry's lock (held by the caller), then the device
            run_worker("quantize", python_module("finetune_flows.models.quantize", job), gpus.env, run_dir / "work")
        if not any(entry.path.glob("*.safetensors")):
            raise StoreError(f"{entry.path}: the quantize worker wrote no weights (*.safetensors)")
        return QuantizedModel.model_validate_json((entry.path / "quantization.json").read_text())

    result, reused = reuse_or_produce(entry, QuantizedModel, produce, outputs=["."])
    run_logger().info("4-bit base model: %d Linear4bit layers, %.1f MiB -> %s", result.linear4bit_layers,
                      result.memory_footprint_mb, entry.path)
    return step_state(result, reused, entry)


if __name__ == "__main__":
    worker_main(_quantize)
