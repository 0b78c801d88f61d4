"""One flow run on the CPU through the real launcher: every worker's job file holds the plan's resolved values (no
`auto`), and the GPU inventory is read once (NVML is faked: there is no GPU here)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import tiny_overrides
from finetune_flows.runtime import launcher
from finetune_flows.runtime.environment import PROBE_DIR_ENV

pytestmark = pytest.mark.slow

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
        result = finetune(None, tiny_overrides(tmp / "cache", tmp / "runs", **{"export.merge": True}))
    finally:
        mp.undo()
        sys.modules.pop("pynvml", None)
    reads = [line.split() for line in log.read_text().splitlines()]
    return result, jobs, reads


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


def test_the_gpu_inventory_is_read_once_per_flow_run(flow_run):
    _, jobs, reads = flow_run
    inventory = [r for r in reads if r[1] == "count"]
    assert [r[2] for r in inventory] == ["read_inventory"], reads
    assert jobs["environment"]["gpus"] == []  # the probe worker got the run's reading instead of reading again
