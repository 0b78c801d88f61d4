"""merge-adapter: the adapter merged into the dequantized weights of its 4-bit base, a store entry
(finetune_flows/export/merge.py); `export_merged_model` puts it in the run directory with its model card
(finetune_flows/export/model_card.py)."""

from __future__ import annotations

from pathlib import Path

from finetune_flows.config.plan import Plan
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.data.dataset import PreparedDataset
from finetune_flows.errors import retry_unless_user_error
from finetune_flows.export import merge
from finetune_flows.export.merge import ExportResult, MergedModel
from finetune_flows.export.model_card import place_merged
from finetune_flows.logs import run_logger
from finetune_flows.models.quantize import QuantizedModel
from finetune_flows.orchestration.caching import CacheKey, StepRun, run_step
from finetune_flows.orchestration.steps import step
from finetune_flows.runtime.environment import EnvironmentReport
from finetune_flows.runtime.gpus import GpuSelection


CACHE_KEY = CacheKey("merged", merge.merge_fingerprint, hashes=(
    "the 4-bit base and dataset keys", "the adapter's files", "export.* settings but export.merge",
    "device and compute dtype"))


@step(name="merge-adapter", cache_key=CACHE_KEY, retries=1, retry_delay_seconds=10,
      retry_condition_fn=retry_unless_user_error, task_run_name="merge-adapter({cfg.run.name}: {cfg.export.dtype})",
      tags=["export", "device"])
def merge_adapter(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter: Path, plan: Plan,
                  gpus: GpuSelection, required: bool = False) -> MergedModel | None:
    """The merged checkpoint (a store entry per base, adapter and export settings), or None when it does not fit
    (`required`: raise instead)."""
    return merge.merge_adapter(cfg, data, base, adapter, plan, gpus, required=required)


def export_merged_model(cfg: FinetuneConfig, data: PreparedDataset, base: QuantizedModel, adapter: Path, plan,
                        gpus, env: EnvironmentReport, run_dir: Path, eval_rows: list[dict],
                        required: bool = False) -> tuple[ExportResult | None, StepRun | None]:
    """Merge (or reuse the merged checkpoint), place it in the run directory with its card; None if skipped. With
    how the merge step ran (None where export.merge is off)."""
    if not (cfg.export.merge or required):
        return None, None
    merged, how = run_step(merge_adapter, cfg, data, base, adapter, plan, gpus, required=required)
    if merged is None:
        return None, how
    return place_merged(merged, run_dir, cfg, base, data, env, eval_rows, adapter), how


def warn_if_the_merge_will_be_skipped(cfg: FinetuneConfig, plan: Plan) -> None:
    """Said at the start, not hours later: within hardware.memory_budget_gib the merged model's check will not fit."""
    if why := merge.budget_skips_merge(cfg, plan):
        run_logger().warning(why)
