"""prepare-dataset: the tokenized train and eval splits, a store entry (finetune_flows/data/dataset.py)."""

from __future__ import annotations

from pathlib import Path

from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.data import dataset
from finetune_flows.errors import retry_unless_user_error
from finetune_flows.orchestration.caching import CacheKey
from finetune_flows.orchestration.steps import step


CACHE_KEY = CacheKey("datasets", dataset.data_fingerprint, hashes=(
    "the data files' bytes, or a Hub dataset's pinned commit", "the tokenizer's files", "every data.* setting"))


@step(name="prepare-dataset", cache_key=CACHE_KEY, retries=1, retry_delay_seconds=5,
      retry_condition_fn=retry_unless_user_error, task_run_name="prepare-dataset({cfg.data.source})", tags=["data"])
def prepare_dataset(cfg: FinetuneConfig, tokenizer_dir: Path):
    """Reuse the verified dataset entry, or build it under the entry's lock."""
    return dataset.prepare_dataset(cfg, tokenizer_dir)
