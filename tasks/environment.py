"""Step 1: verify the environment and check the run configuration against it.

The probe runs in a child process (so the orchestrator never initialises CUDA) and reports torch/CUDA, the GPUs,
the versions of the whole stack, which attention backends can run, and whether the Hub is reachable. Then
`resolve_plan` turns the config's `auto` choices into concrete ones, or lists every requirement this machine
cannot meet.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import sys
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from tasks.config import ATTENTION_BACKENDS, FinetuneConfig
from tasks.errors import EnvironmentMismatch
from tasks.gpus import GpuInfo, GpuSelection, read_inventory, selection_for
from tasks.launcher import python_module, run_logger, run_worker, worker_main, write_job

STACK = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "prefect", "kernels",
         "flash-attn", "flash-attn-3", "flash-attn-4", "liger-kernel", "pydantic", "nvidia-ml-py", "triton")


class EnvironmentReport(BaseModel):
    python: str
    platform: str
    torch: str
    cuda_available: bool
    cuda_version: str | None
    driver_version: str | None
    gpus: list[GpuInfo]
    versions: dict[str, str | None]
    attention: dict[str, str]  # backend -> "available" or the reason it is not
    bitsandbytes_4bit: str  # "available" or why not
    hub_reachable: bool
    visible_devices: str | None = None  # an inherited CUDA_VISIBLE_DEVICES: only those GPUs may be selected

    def usable(self, backend: str) -> bool:
        return self.attention.get(backend) == "available"


class Plan(BaseModel):
    """The config's `auto` choices made concrete for this machine and GPU selection."""

    device: str  # "cuda" or "cpu"
    gpu_ids: list[int]
    nproc: int
    precision: str  # bf16 | fp16 | fp32
    compute_dtype: str  # bfloat16 | float16 | float32
    train_attn: str
    eval_attn: str


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _hub_reachable() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=2).close()
        return True
    except OSError:
        return False


def _attention_backends(gpus: list[GpuInfo], cuda: bool, versions: dict[str, str | None]) -> dict[str, str]:
    from transformers.utils import import_utils as iu

    best_cc = max((g.capability for g in gpus), default=(0, 0))
    out = {"eager": "available", "sdpa": "available"}
    if not cuda:
        reason = "needs a CUDA GPU"
        out.update({b: reason for b in ("flash_attention_2", "flash_attention_3", "flash_attention_4")})
    else:
        out["flash_attention_2"] = (
            "available" if iu.is_flash_attn_2_available() and best_cc >= (8, 0)
            else "flash-attn 2 not installed" if not versions.get("flash-attn") else "needs compute capability >= 8.0"
        )
        out["flash_attention_3"] = (
            "available" if iu.is_flash_attn_3_available() and best_cc[0] == 9
            else "flash-attn-3 not installed" if not versions.get("flash-attn-3") else "needs Hopper (sm_90)"
        )
        out["flash_attention_4"] = (
            "available" if iu.is_flash_attn_4_available() and best_cc[0] in (9, 10)
            else "flash-attn-4 not installed" if not versions.get("flash-attn-4") else "needs Hopper or Blackwell"
        )
    out["hub_kernels"] = "available" if iu.is_kernels_available() else (
        "kernels not installed" if not versions.get("kernels") else f"kernels {versions['kernels']} not accepted "
        f"by transformers {versions.get('transformers')}"
    )
    return out


def probe() -> EnvironmentReport:
    """Inspect this process's view of the machine (call it in a child with the environment to check)."""
    import torch

    versions = {d: _version(d) for d in STACK}
    gpus = read_inventory()
    driver = None
    if gpus:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        pynvml.nvmlShutdown()
    cuda = torch.cuda.is_available()
    try:
        import bitsandbytes  # noqa: F401

        bnb = "available"
    except Exception as exc:  # missing, or a build without this platform's library
        bnb = f"bitsandbytes cannot be imported: {exc}".splitlines()[0]
    return EnvironmentReport(
        python=sys.version.split()[0], platform=platform.platform(), torch=torch.__version__,
        cuda_available=cuda, cuda_version=torch.version.cuda, driver_version=driver, gpus=gpus,
        versions=versions, attention=_attention_backends(gpus, cuda, versions), bitsandbytes_4bit=bnb,
        hub_reachable=_hub_reachable(), visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def resolve_plan(cfg: FinetuneConfig, env: EnvironmentReport, selection: GpuSelection) -> Plan:
    """Every `auto` made concrete; every requirement the machine cannot meet reported together."""
    problems: list[str] = []
    gpus = selection.gpus
    on_gpu = bool(gpus)
    if on_gpu and not env.cuda_available:
        problems.append(f"hardware.gpus={cfg.hardware.gpus} selects GPUs, but torch {env.torch} cannot use CUDA")

    # precision: the weakest selected GPU decides
    no_bf16 = [g for g in gpus if not g.supports_bf16]
    p = cfg.train.precision
    if p == "auto":
        p = "fp32" if not on_gpu else ("fp16" if no_bf16 else "bf16")
    if p == "bf16" and no_bf16:
        problems.extend(f"train.precision=bf16, but GPU {g.index} ({g.name}, compute capability "
                        f"{g.capability[0]}.{g.capability[1]}) has no bf16; use fp16 or auto" for g in no_bf16)
    if p == "fp16" and not on_gpu:
        problems.append("train.precision=fp16 needs a GPU; on the CPU use fp32, bf16 or auto")
    compute = cfg.quantization.compute_dtype
    if compute == "auto":
        compute = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[p]
    elif compute == "bfloat16" and no_bf16:
        problems.append(f"quantization.compute_dtype=bfloat16, but GPU {no_bf16[0].index} ({no_bf16[0].name}) "
                        "has no bf16")

    if cfg.quantization.load_in_4bit and env.bitsandbytes_4bit != "available":
        problems.append(f"quantization.load_in_4bit needs bitsandbytes: {env.bitsandbytes_4bit}")

    # attention: one place decides
    want = cfg.hardware.attn_implementation
    if want == "auto":
        eval_attn = next((b for b in ("flash_attention_4", "flash_attention_3", "flash_attention_2")
                          if on_gpu and env.usable(b) and p != "fp32"), "sdpa")
        # FA4's backward and packed paths are young: train with FA3/FA2 when present, else SDPA.
        train_attn = next((b for b in ("flash_attention_3", "flash_attention_2")
                           if on_gpu and env.usable(b) and p != "fp32"), "sdpa")
    else:
        eval_attn = train_attn = want
        if want in ATTENTION_BACKENDS and not env.usable(want):
            problems.append(f"hardware.attn_implementation={want} cannot run here: {env.attention.get(want)}")
        if want.startswith("flash_attention") and p == "fp32":
            problems.append(f"hardware.attn_implementation={want} needs fp16 or bf16, but precision is fp32")
        if want not in ATTENTION_BACKENDS:  # a Hub kernel id
            if not env.usable("hub_kernels"):
                problems.append(f"hardware.attn_implementation={want} needs Hub kernels: {env.attention['hub_kernels']}")
            elif not env.hub_reachable:
                problems.append(f"hardware.attn_implementation={want} downloads a kernel, but the Hub is unreachable")

    src = cfg.model.source
    if not (src.startswith(("builtin:", "generated:")) or Path(src).expanduser().exists()) and not env.hub_reachable:
        problems.append(f"model.source={src} is neither a built-in, a generated model nor an existing local path, "
                        "and the Hugging Face Hub is unreachable")
    if cfg.data.source.startswith("hub:") and not env.hub_reachable:
        problems.append(f"data.source={cfg.data.source} needs the Hugging Face Hub, which is unreachable")
    if problems:
        raise EnvironmentMismatch(problems, "config vs environment")
    nproc = len(selection.ids) if on_gpu else cfg.hardware.cpu_processes
    return Plan(device=selection.device_type, gpu_ids=selection.ids, nproc=nproc, precision=p,
                compute_dtype=compute, train_attn=train_attn, eval_attn=eval_attn)


def report_markdown(env: EnvironmentReport, plan: Plan | None = None) -> str:
    lines = ["# Environment", "", "| item | value |", "|---|---|",
             f"| python | {env.python} |", f"| platform | {env.platform} |", f"| torch | {env.torch} |",
             f"| CUDA available | {env.cuda_available} (CUDA {env.cuda_version}, driver {env.driver_version}) |",
             f"| bitsandbytes 4-bit | {env.bitsandbytes_4bit} |", f"| Hub reachable | {env.hub_reachable} |"]
    lines += ["", "## GPUs", ""]
    if env.visible_devices is not None:
        lines += [f"CUDA_VISIBLE_DEVICES={env.visible_devices} (inherited) limits the selection to the GPUs marked "
                  "usable; ids are nvidia-smi ids.", ""]
    if env.gpus:
        lines += ["| id | name | capability | bf16 | memory total (MiB) | free (MiB) | usable |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {g.index} | {g.name} | {g.capability[0]}.{g.capability[1]} | {g.supports_bf16} | "
                  f"{g.memory_total_mib} | {g.memory_free_mib} | "
                  f"{'yes' if g.usable else 'no: MIG mode' if g.mig else 'no: not in CUDA_VISIBLE_DEVICES'} |"
                  for g in env.gpus]
    else:
        lines.append("none (CPU only)")
    lines += ["", "## Attention backends", "", "| backend | status |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.attention.items()]
    lines += ["", "## Versions", "", "| package | version |", "|---|---|"]
    lines += [f"| {k} | {v or 'not installed'} |" for k, v in env.versions.items()]
    if plan is not None:
        lines += ["", "## Resolved plan", "", "| choice | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in plan.model_dump().items()]
    return "\n".join(lines) + "\n"


def run_probe(workdir: Path) -> EnvironmentReport:
    job = write_job(workdir, "environment")
    # CUDA_DEVICE_ORDER makes torch's numbering match nvidia-smi's, as for every worker.
    result = run_worker("environment", python_module("tasks.environment", job), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
                        workdir)
    return EnvironmentReport.model_validate(result)


@task(name="verify-environment", task_run_name="verify-environment[gpus={cfg.hardware.gpus}]", tags=["setup"])
def verify_environment(cfg: FinetuneConfig, run_dir: Path) -> tuple[EnvironmentReport, Plan]:
    """Probe the machine, publish the report, and check the config against it (all problems at once)."""
    env = run_probe(run_dir / "work")
    # the one reading of the GPUs: select_gpus computes the workers' selection from this same inventory
    plan = resolve_plan(cfg, env, selection_for(cfg.hardware.gpus, env.gpus))  # names a missing/unusable GPU
    from tasks.distributed import plan_problems  # imports this module

    if problems := plan_problems(cfg, plan):
        raise EnvironmentMismatch(problems, "config vs environment")
    md = report_markdown(env, plan)
    (run_dir / "environment.md").write_text(md)
    create_markdown_artifact(md, key="environment-report", description="Machine, stack and resolved plan")
    run_logger().info("plan: %s", plan.model_dump())
    return env, plan


if __name__ == "__main__":
    worker_main(lambda job: probe().model_dump(mode="json"))
