"""train-adapter: the LoRA adapter, a store entry; a retry resumes from its last complete checkpoint
(finetune_flows/training/train.py). The flow sets its retries from `train.retries`."""

from __future__ import annotations

from pathlib import Path

from finetune_flows.config.plan import Plan
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.data.dataset import PreparedDataset
from finetune_flows.errors import retry_unless_user_error
from finetune_flows.models.quantize import QuantizedModel
from finetune_flows.orchestration.caching import CacheKey
from finetune_flows.orchestration.steps import step
from finetune_flows.runtime.gpus import GpuSelection
from finetune_flows.training import train


CACHE_KEY = CacheKey("adapters", train.train_fingerprint, hashes=(
    "the dataset and 4-bit base keys", "every lora.* setting", "train.* less TRAIN_KEYS_NOT_IN_CACHE_KEY",
    "ranks, device, resolved precision and attention", "the launch (launcher, nodes, strategy)"))


@step(name="train-adapter", cache_key=CACHE_KEY, retry_condition_fn=retry_unless_user_error,
      task_run_name="train-adapter({cfg.run.name}: {cfg.train.length})", tags=["training", "device"])
def train_adapter(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, plan: Plan, gpus: GpuSelection,
                  run_dir: Path):
    """Reuse the verified adapter, or train it under the entry's lock (held for the whole attempt, so no other
    run writes the checkpoints it resumes from); a retry resumes from the last complete checkpoint."""
    return train.train_adapter(cfg, data, base, plan, gpus, run_dir)
