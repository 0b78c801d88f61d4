"""The plan is what workers receive: one flow run on the CPU through the real launcher, where every worker's job file
holds the plan's resolved values (no `auto`) and the GPU inventory is read once (NVML is faked: there is no GPU
here); and a GPU plan's worker config on an injected inventory."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import tiny_config
from finetune_flows.config.plan import worker_config
from finetune_flows.config.schema import load_config
from finetune_flows.models.sources import ARCHS
from finetune_flows.runtime import launcher
from finetune_flows.runtime.environment import PROBE_DIR_ENV, EnvironmentReport, resolve_plan
from finetune_flows.runtime.gpus import GpuInfo, selection_for
from finetune_flows.training.planner import ModelShape, plan_training

# A stand-in for nvidia-ml-py with no GPU, which logs who asked NVML for its devices (and from which process).
FAKE_NVML = '''
import os, sys

class NVMLError(Exception):
    pass

NVML_DEVICE_MIG_ENABLE = 1

def _log(what):
    with open(os.environ["FAKE_NVML_LOG"], "a") as log:
        log.write(f"{os.getpid()} {what} {sys._getframe(2).f_code.co_name}\\n")

def nvmlInit():
    pass

def nvmlShutdown():
    pass

def nvmlDeviceGetCount():
    _log("count")
    return 0

def nvmlSystemGetDriverVersion():
    _log("driver")
    return "0"
'''


def unresolved(value, where: str = "") -> list[str]:
    """The key paths in a job's JSON that hold `auto` (or `auto:N`)."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in unresolved(v, f"{where}.{k}" if where else k)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in unresolved(v, f"{where}[{i}]")]
    return [where] if isinstance(value, str) and (value == "auto" or value.startswith("auto:")) else []


def test_unresolved_finds_auto_at_any_depth():
    assert unresolved({"a": {"b": ["x", "auto"]}, "c": "auto:2", "d": "automatic"}) == ["a.b[1]", "c"]


def test_a_gpu_plans_worker_config_holds_its_values_and_no_auto():
    h200 = GpuInfo(index=0, name="NVIDIA H200", memory_total_mib=143771, memory_free_mib=140000, capability=(9, 0))
    env = EnvironmentReport(python="3.11", platform="linux", torch="2.13", cuda_available=True, cuda_version="13.0",
                            driver_version=None, gpus=[h200], versions={}, bitsandbytes_4bit="available",
                            attention={"eager": "available", "sdpa": "available"}, hub_reachable=False)
    cfg = load_config(None, ["model.source=generated:qwen3-0.6b", "hardware.strategy=auto"])
    selection = selection_for("auto", [h200])
    plan = resolve_plan(cfg, env, selection)
    assert (plan.precision, plan.strategy, plan.dequantize_base, plan.compile) == ("bf16", "ddp", True, "deferred")
    before_training = worker_config(cfg, plan, selection.ids)  # quantize: no train or data section yet
    assert "train" not in before_training and "data" not in before_training and unresolved(before_training) == []
    training = plan_training(
        ModelShape.from_config(ARCHS["qwen3-0.6b"]), free_mib=selection.planning_mib(), max_row=512, mean_row=300.0,
        rows_per_step=64, packing=True, micro_batch_tokens=None, checkpointing="auto", four_bit=True, lora_r=16,
        lora_targets="all-linear", fused_ce=plan.liger, upcast=plan.upcast_frozen, dequantize=plan.dequantize_base,
        compile_layers=plan.compile != "off", compile_deferred=plan.compile == "deferred")
    refined = plan.with_training(training)
    assert refined.compile == "deferred" and refined.dequantize_base  # 140 GB free: the copy fits
    kept_4bit = training.model_copy(update={"dequantize_base": False, "compile_layers": False,
                                            "compile_deferred": False})
    assert (plan.with_training(kept_4bit).compile, plan.with_training(kept_4bit).dequantize_base) == ("off", False)
    job = worker_config(cfg, refined, selection.ids, "chat")
    assert unresolved(job) == []
    assert job["hardware"]["gpus"] == "0" and job["quantization"]["compute_dtype"] == "bfloat16"
    assert job["train"]["compile"] is True and training.compile_deferred  # when: the plan's compile: deferred
    assert job["train"]["micro_batch_tokens"] == training.micro_batch_tokens and job["data"]["format"] == "chat"
    assert "ray_address" not in job["hardware"]  # torchrun: Ray's own `auto` keyword is left out
    ray = worker_config(load_config(None, ["hardware.launcher=ray"]), plan, [])
    assert unresolved(ray) == ["hardware.ray_address"]  # passed to ray.init as written


@pytest.fixture(scope="module")
def flow_run(prefect_server, tmp_path_factory):
    """The finetune flow on a fresh cache and probe folder (every worker runs), recording each job file a worker
    is started with as it was when the worker started."""
    from flows.finetune import finetune

    tmp = tmp_path_factory.mktemp("plan")
    fake = tmp / "fake-nvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(textwrap.dedent(FAKE_NVML))
    log = tmp / "nvml.log"
    log.touch()
    jobs: dict[str, dict] = {}
    start = launcher.start_worker

    def recording(step, argv, env, logger):
        for arg in argv:
            if arg.endswith(".job.json"):
                jobs[step] = json.loads(Path(arg).read_text())
        return start(step, argv, env, logger)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(launcher, "start_worker", recording)
        mp.setenv("FAKE_NVML_LOG", str(log))
        mp.setenv("PYTHONPATH", f"{fake}:{__import__('os').environ.get('PYTHONPATH', '')}")  # the workers' NVML
        mp.setenv(PROBE_DIR_ENV, str(tmp / "probes"))
        mp.syspath_prepend(str(fake))
        mp.delitem(sys.modules, "pynvml", raising=False)  # this process's NVML: the fake
        result = finetune(tiny_config(tmp / "cache", tmp / "runs", **{"export.merge": True}))
    finally:
        mp.undo()
        sys.modules.pop("pynvml", None)
    reads = [line.split() for line in log.read_text().splitlines()]
    return result, jobs, reads


@pytest.mark.slow
def test_no_worker_job_holds_an_unresolved_auto(flow_run):
    result, jobs, _ = flow_run
    assert {"environment", "quantize", "train", "evaluate", "export"} <= set(jobs), sorted(jobs)
    assert {step: unresolved(job) for step, job in jobs.items() if unresolved(job)} == {}
    train = jobs["train"]
    assert train["plan"]["training"]["micro_batch_tokens"] > 0  # the memory planner's choice travels in the plan
    assert train["plan"]["compile"] == "off" and train["plan"]["liger"] is False  # on the CPU
    assert train["config"]["train"]["gradient_checkpointing"] == train["plan"]["training"]["gradient_checkpointing"]
    assert train["config"]["hardware"]["gpus"] == "cpu" and train["config"]["eval"]["engine"] == "static"
    assert result.eval.table()  # the run finished with its evaluation


@pytest.mark.slow
def test_the_gpu_inventory_is_read_once_per_flow_run(flow_run):
    _, jobs, reads = flow_run
    inventory = [r for r in reads if r[1] == "count"]
    assert [r[2] for r in inventory] == ["read_inventory"], reads
    assert jobs["environment"]["gpus"] == []  # the probe worker got the run's reading instead of reading again
