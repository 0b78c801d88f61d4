"""evaluate-checkpoint: base vs a merged checkpoint on the held-out split, a store entry
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


CACHE_KEY = CacheKey("evals", evaluate.checkpoint_eval_fingerprint, hashes=(
    "the dataset and 4-bit base keys", "the checkpoint's content, not its path or model card",
    "every eval.* setting (attention as resolved)", "the evaluation's attention backend, dtype and device"))


@step(name="evaluate-checkpoint", cache_key=CACHE_KEY, retries=1, retry_delay_seconds=10,
      retry_condition_fn=retry_unless_user_error, tags=["evaluation", "device"],
      task_run_name="evaluate-checkpoint({cfg.run.name}: {cfg.eval.max_samples} samples, {plan.eval_attn})")
def evaluate_checkpoint(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, checkpoint: Path,
                        plan: Plan, gpus: GpuSelection):
    """Score base and a merged checkpoint, reusing a verified evaluation of the same inputs (keyed by the
    checkpoint's content, wherever it lies)."""
    return evaluate.evaluate_checkpoint(cfg, data, base, checkpoint, plan, gpus)
