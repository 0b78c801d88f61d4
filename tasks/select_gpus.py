"""select-gpus: the GPUs the workers get, from the environment probe's reading (finetune_flows/runtime/gpus.py)."""

from __future__ import annotations

from finetune_flows.orchestration.steps import step
from finetune_flows.runtime import gpus
from finetune_flows.runtime.gpus import GpuInfo, GpuSelection


CACHE_KEY = None  # no store entry: a choice from the probe's reading, made every run


@step(name="select-gpus", cache_key=CACHE_KEY, task_run_name="select-gpus({spec})", tags=["setup"])
def select_gpus(spec: str, inventory: list[GpuInfo]) -> GpuSelection:
    """Pick GPUs from the environment probe's reading (the one `hardware.gpus` was checked against) and log it."""
    return gpus.select_gpus(spec, inventory)
