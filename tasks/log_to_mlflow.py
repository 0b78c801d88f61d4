"""log-to-mlflow: a finished run logged to `tracking.mlflow_uri` (finetune_flows/reporting/tracking.py)."""

from __future__ import annotations

from finetune_flows.config.plan import Plan
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.orchestration.steps import step
from finetune_flows.reporting import tracking


CACHE_KEY = None  # no store entry: each finished run is logged once, to the tracking server


@step(name="log-to-mlflow", cache_key=CACHE_KEY, retries=0,  # tracking.log_to_mlflow tries twice itself
      task_run_name="log-to-mlflow({cfg.run.name})", tags=["tracking"])
def log_to_mlflow(cfg: FinetuneConfig, plan: Plan, result) -> str:
    """Log a finished run (a FinetuneResult) to `tracking.mlflow_uri`; return the MLflow run id."""
    return tracking.log_to_mlflow(cfg, plan, result)
