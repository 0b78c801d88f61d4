"""verify-environment: probe the machine, then check the run's config against it and resolve its plan
(finetune_flows/runtime/environment.py)."""

from __future__ import annotations

from pathlib import Path

from finetune_flows.config.plan import Plan
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.orchestration.steps import step
from finetune_flows.runtime import environment
from finetune_flows.runtime.environment import EnvironmentReport
from finetune_flows.runtime.gpus import GpuInfo


# No store entry: the GPUs' free memory and the Hub's reachability are read every run (the probe of the installed
# stack is reused where it still describes the machine: runtime/environment.py).
CACHE_KEY = None


@step(name="verify-environment", cache_key=CACHE_KEY, task_run_name="verify-environment(gpus={cfg.hardware.gpus})",
      tags=["setup"])
def verify_environment(cfg: FinetuneConfig, run_dir: Path,
                       inventory: list[GpuInfo] | None = None) -> tuple[EnvironmentReport, Plan]:
    """Probe the machine, publish the report, and check the config against it (all problems at once)."""
    return environment.verify_environment(cfg, run_dir, inventory)
