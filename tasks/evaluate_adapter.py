"""evaluate-adapter: base vs base + adapter on the held-out split, a store entry
(finetune_flows/evaluation/evaluate.py)."""

from __future__ import annotations

from pathlib import Path

from finetune_flows.config.plan import Plan
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.data.dataset import PreparedDataset
from finetune_flows.errors import retry_unless_user_error
from finetune_flows.evaluation import evaluate
from finetune_flows.models.quantize import QuantizedModel
from finetune_flows.orchestration.caching import CacheKey
from finetune_flows.orchestration.steps import step
from finetune_flows.runtime.gpus import GpuSelection


CACHE_KEY = CacheKey("evals", evaluate.eval_fingerprint, hashes=(
    "the dataset and 4-bit base keys", "the adapter's files", "every eval.* setting (attention as resolved)",
    "the evaluation's attention backend, dtype and device"))


@step(name="evaluate-adapter", cache_key=CACHE_KEY, retries=1, retry_delay_seconds=10,
      retry_condition_fn=retry_unless_user_error, tags=["evaluation", "device"],
      task_run_name="evaluate-adapter({cfg.run.name}: {cfg.eval.max_samples} samples, {plan.eval_attn})")
def evaluate_adapter(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter_path: Path,
                     plan: Plan, gpus: GpuSelection):
    """Score base and base + adapter, reusing a verified evaluation of the same inputs."""
    return evaluate.evaluate_adapter(cfg, data, base, adapter_path, plan, gpus)
