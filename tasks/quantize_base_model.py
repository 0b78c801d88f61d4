"""quantize-base-model: the 4-bit base checkpoint, a store entry (finetune_flows/models/quantize.py)."""

from __future__ import annotations

from pathlib import Path

from finetune_flows.config.plan import Plan
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.errors import retry_unless_user_error
from finetune_flows.models import quantize
from finetune_flows.orchestration.caching import CacheKey
from finetune_flows.orchestration.steps import step
from finetune_flows.runtime.gpus import GpuSelection


CACHE_KEY = CacheKey("quantized", quantize.quantize_fingerprint, hashes=(
    "the model's identity (model.source, model.revision)", "model.trust_remote_code", "every quantization.* setting",
    "the resolved compute dtype, storage dtype and device"))


@step(name="quantize-base-model", cache_key=CACHE_KEY, retries=1, retry_delay_seconds=10,
      retry_condition_fn=retry_unless_user_error, task_run_name="quantize-base-model({cfg.model.source})",
      tags=["model", "device"])
def quantize_base_model(cfg: FinetuneConfig, plan: Plan, gpus: GpuSelection, run_dir: Path):
    """Reuse the verified 4-bit checkpoint, or quantize it under the entry's lock; report its memory footprint."""
    return quantize.quantize_base_model(cfg, plan, gpus, run_dir)
