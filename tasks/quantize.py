"""Step 4: load the base model in 4-bit (bitsandbytes NF4, double quantization) and keep that checkpoint.

Quantizing once and saving the 4-bit weights means training ranks, evaluation and retries load ~4x fewer bytes
and skip re-quantization. Cached on the model's identity, the quantization settings and the compute dtype.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import task
from pydantic import BaseModel

from tasks.concurrency import produce_on_devices
from tasks.config import FinetuneConfig, QuantizationConfig
from tasks.environment import Plan
from tasks.errors import retry_unless_user_error
from tasks.fingerprint import code_version, combine
from tasks.gpus import GpuSelection
from tasks.launcher import python_module, run_logger, run_worker, worker_main, write_job
from tasks.models import materialize_model, model_identity
from tasks.runs import atomic_dir


class QuantizedModel(BaseModel):
    path: Path  # a checkpoint that from_pretrained loads as 4-bit (or the plain checkpoint without 4-bit)
    fingerprint: str
    load_in_4bit: bool
    compute_dtype: str
    memory_footprint_mb: float
    linear4bit_layers: int
    quantize_seconds: float

    def is_complete(self) -> bool:
        return (self.path / "config.json").is_file()


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def bnb_config(q: QuantizationConfig, compute_dtype: str):
    """The single place that builds the BitsAndBytesConfig."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=q.quant_type, bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(compute_dtype),
    )


def count_4bit_layers(model) -> int:
    import bitsandbytes as bnb

    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def quantize_fingerprint(cfg: FinetuneConfig, plan: Plan) -> str:
    return combine(model_identity(cfg.model.source, cfg.model.revision), cfg.quantization.fingerprint(),
                   plan.compute_dtype, plan.device, code_version("quantize", "models"))


def _quantize(job: dict) -> dict:
    """Worker body: runs in a child process that sees only the selected GPUs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = FinetuneConfig.model_validate(job["config"])
    compute_dtype, out = job["compute_dtype"], Path(job["out"])
    src = materialize_model(cfg.model.source, cfg.cache_root, cfg.model.revision, cfg.model.trust_remote_code)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=bnb_config(cfg.quantization, compute_dtype), device_map={"": device},
        dtype=torch_dtype(compute_dtype), revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code,
    )
    layers = count_4bit_layers(model)
    first = next(m for m in model.modules() if type(m).__name__ == "Linear4bit")
    print(f"quantized {layers} linear layers to 4-bit {cfg.quantization.quant_type} on {first.weight.device} "
          f"(compute {compute_dtype}); footprint {model.get_memory_footprint() / 2**20:.1f} MiB", flush=True)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(src, revision=cfg.model.revision).save_pretrained(tmp)
        result = dict(path=str(out), fingerprint=job["fingerprint"], load_in_4bit=True, compute_dtype=compute_dtype,
                      memory_footprint_mb=round(model.get_memory_footprint() / 2**20, 2), linear4bit_layers=layers,
                      quantize_seconds=round(time.perf_counter() - started, 2), device=str(first.weight.device))
        (tmp / "quantization.json").write_text(json.dumps(result, indent=2))
    return result


def _quantize_key(context, parameters) -> str:
    return "quantized-" + quantize_fingerprint(parameters["cfg"], parameters["plan"])


@task(name="quantize-base-model", cache_key_fn=_quantize_key, persist_result=True, retries=1,
      retry_delay_seconds=10, retry_condition_fn=retry_unless_user_error,
      task_run_name="quantize-base-model[{cfg.model.source}]", tags=["model", "device"])
def quantize_base_model(cfg: FinetuneConfig, plan: Plan, gpus: GpuSelection, run_dir: Path) -> QuantizedModel:
    """Quantize (or reuse) the 4-bit base checkpoint; report its memory footprint."""
    fingerprint = quantize_fingerprint(cfg, plan)
    out = cfg.cache_root / "quantized" / fingerprint
    if not cfg.quantization.load_in_4bit:
        path = materialize_model(cfg.model.source, cfg.cache_root, cfg.model.revision)
        return QuantizedModel(path=path, fingerprint=fingerprint, load_in_4bit=False, compute_dtype=plan.compute_dtype,
                              memory_footprint_mb=0.0, linear4bit_layers=0, quantize_seconds=0.0)

    def launch() -> None:
        job = write_job(run_dir / "work", "quantize", config=cfg.model_dump(mode="json"), out=str(out),
                        compute_dtype=plan.compute_dtype, fingerprint=fingerprint)
        run_worker("quantize", python_module("tasks.quantize", job), gpus.env, run_dir / "work")

    produce_on_devices(out / "quantization.json", gpus.ids, launch)
    result = QuantizedModel.model_validate_json((out / "quantization.json").read_text())
    run_logger().info("4-bit base model: %d Linear4bit layers, %.1f MiB -> %s", result.linear4bit_layers,
                      result.memory_footprint_mb, out)
    return result


if __name__ == "__main__":
    worker_main(_quantize)
