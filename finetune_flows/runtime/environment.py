"""Step 1: verify the environment and check the run configuration against it.

The probe runs in a child process (so the orchestrator never initialises CUDA) and reports torch/CUDA, the GPUs
(the flow run's one reading, handed to it), the versions of the whole stack, which attention backends can run, and
whether the Hub is reachable. Then `resolve_plan` turns every `auto` of the config into the run's plan
(finetune_flows/config/plan.py), or lists every requirement this machine cannot meet.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import socket
import sys
from pathlib import Path

from pydantic import BaseModel

from finetune_flows.models.backends import (
    BackendTiming, attention_shape, installed, measured_timings, resolve_attention,
)
from finetune_flows.config.plan import Plan, loss_chunk_setting, training_settings
from finetune_flows.packages import installed_version
from finetune_flows.config.schema import FinetuneConfig
from finetune_flows.errors import EnvironmentMismatch, WorkerFailed
from finetune_flows.evaluation.generation import choose_engine, continuous_supports
from finetune_flows.models.kernels import check_kernels
from finetune_flows.runtime.gpus import GpuInfo, GpuSelection, read_inventory, selection_for
from finetune_flows.runtime.launcher import python_module, run_worker, write_job
from finetune_flows.logs import run_logger
from finetune_flows.runtime.lifecycle import worker_main
from finetune_flows.store.entries import Entry, reuse_or_record
from finetune_flows.store.fingerprint import uncached_hub_sources
from finetune_flows.training.distributed import plan_problems, world_size
from finetune_flows.training.planner import GIB, OUTSIDE_ALLOCATOR, allocator_bytes, memory_parts
from finetune_flows.training.sharding import readable_model_shape, resolve_strategy

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
    attention: dict[str, str]  # backend -> "available" (installed here) or why not; GPU fit: backends.usable
    bitsandbytes_4bit: str  # "available" or why not
    hub_reachable: bool
    attention_timings: list[BackendTiming] = []  # the attention probes behind `auto` (models/backends.py)
    kernels: dict[str, str] = {}  # hardware.kernels layer -> "loads (...)" or why not (models/kernels.py)
    cpu_bf16: bool = False  # native bf16 matrix instructions on this CPU (AVX512-BF16 or AMX)
    visible_devices: str | None = None  # an inherited CUDA_VISIBLE_DEVICES: only those GPUs may be selected

    def usable(self, backend: str) -> bool:
        return self.attention.get(backend) == "available"


def hub_reachable() -> bool:
    """Whether the Hugging Face Hub answers (a TCP connection within 2 s); never when HF_HUB_OFFLINE is set."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=2).close()
        return True
    except OSError:
        return False


def _cpu_bf16() -> bool:
    import torch

    features = ("avx512_bf16", "amx_tile")
    return any(getattr(torch.cpu, f"_is_{feature}_supported", lambda: False)() for feature in features)


def probe(gpus: list[GpuInfo], kernels: dict[str, str] | None = None) -> EnvironmentReport:
    """Inspect this process's view of the machine (call it in a child with the environment to check), and
    whether the configured layer kernels load. `gpus` is the run's one reading of the inventory."""
    import torch

    versions = {d: installed_version(d) for d in STACK}
    driver = _driver_version() if gpus else None
    cuda = torch.cuda.is_available()
    try:
        import bitsandbytes  # noqa: F401

        bnb = "available"
    except Exception as exc:  # missing, or a build without this platform's library
        bnb = f"bitsandbytes cannot be imported: {exc}".splitlines()[0]
    return EnvironmentReport(
        python=sys.version.split()[0], platform=platform.platform(), torch=torch.__version__,
        cuda_available=cuda, cuda_version=torch.version.cuda, driver_version=driver, gpus=gpus,
        versions=versions, attention=installed(cuda, versions), bitsandbytes_4bit=bnb,
        hub_reachable=hub_reachable(), kernels=check_kernels(kernels or {}), cpu_bf16=_cpu_bf16(),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def auto_eval_dtype(cfg: FinetuneConfig, on_gpu: bool, cpu_bf16: bool, compute: str) -> str:
    """`eval.dtype: auto`: the compute dtype, except on a CPU with native bf16 for models whose layers are wide
    enough for matrix products to dominate (on narrower ones the time goes to attention over small heads, where
    bf16 is slower). bitsandbytes' 4-bit CPU kernel computes in bf16 on such CPUs too."""
    shape = attention_shape(cfg)
    wide = shape["heads"] * shape["head_dim"] >= 256
    return "bfloat16" if not on_gpu and cpu_bf16 and wide else compute


def cpu_half_precision_problems(cfg: FinetuneConfig) -> list[str]:
    """The float16 settings that need a GPU, for a run on the CPU."""
    problems = []
    if cfg.train.precision == "fp16":
        problems.append("train.precision=fp16 needs a GPU; on the CPU use fp32, bf16 or auto")
    if cfg.eval.dtype == "float16":
        problems.append("eval.dtype=float16 needs a GPU; on the CPU use float32, bfloat16 or auto")
    return problems


def resolve_plan(cfg: FinetuneConfig, env: EnvironmentReport, selection: GpuSelection,
                 timings: list[BackendTiming] | None = None) -> Plan:
    """Every `auto` made concrete; every requirement the machine cannot meet reported together.

    `timings` are the attention probes of the selected GPUs (models/backends.py); without them `auto` attention is
    sdpa."""
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
    if not on_gpu:
        problems += cpu_half_precision_problems(cfg)
    compute = cfg.quantization.compute_dtype
    if compute == "auto":
        compute = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[p]
    elif compute == "bfloat16" and no_bf16:
        problems.append(f"quantization.compute_dtype=bfloat16, but GPU {no_bf16[0].index} ({no_bf16[0].name}) "
                        "has no bf16")

    if cfg.quantization.load_in_4bit and env.bitsandbytes_4bit != "available":
        problems.append(f"quantization.load_in_4bit needs bitsandbytes: {env.bitsandbytes_4bit}")

    train_attn, eval_attn, why, attention_problems = resolve_attention(
        cfg.hardware.attn_implementation, env.attention, gpus, p, env.hub_reachable, timings,
        packed=cfg.train.packing)
    problems += attention_problems
    if cfg.eval.attn_implementation not in (None, cfg.hardware.attn_implementation):  # evaluation's own choice
        _, eval_attn, eval_why, attention_problems = resolve_attention(
            cfg.eval.attn_implementation, env.attention, gpus, p, env.hub_reachable, timings,
            key="eval.attn_implementation")
        why, problems = {**why, "eval": eval_why["eval"]}, problems + attention_problems
    if cfg.eval.engine == "continuous" and not continuous_supports(eval_attn):
        problems.append(f"eval.engine=continuous cannot use attention backend {eval_attn}: continuous batching "
                        "supports sdpa, eager and flash attention; use eval.engine=static or auto")

    eval_dtype = cfg.eval.dtype
    if eval_dtype == "auto":
        eval_dtype = auto_eval_dtype(cfg, on_gpu, env.cpu_bf16, compute)
    elif eval_dtype == "bfloat16" and no_bf16:
        problems.append(f"eval.dtype=bfloat16, but GPU {no_bf16[0].index} ({no_bf16[0].name}) has no bf16")

    # on the host that loads them: Hub sources the local Hub cache holds need no Hub (the flow pinned their commits)
    for key, source, _, _, kind in [] if env.hub_reachable else uncached_hub_sources(cfg):
        what = ("is neither a built-in, a generated model, an existing local path nor in the local Hub cache,"
                if kind == "model" else "is not in the local Hub cache")
        problems.append(f"{key}={source} {what} and the Hugging Face Hub is unreachable")
    budget = cfg.hardware.memory_budget_gib
    problems += [f"hardware.memory_budget_gib={budget:g} is more than GPU {g.index} ({g.name}) has: "
                 f"{g.memory_total_mib / 1024:.1f} GiB; set at most that, or null for the whole GPU"
                 for g in gpus if budget is not None and budget * 1024 > g.memory_total_mib]
    if problems:
        raise EnvironmentMismatch(problems, "config vs environment")
    nproc = len(selection.ids) if on_gpu else cfg.hardware.cpu_processes
    plan = Plan(device=selection.device_type, nproc=nproc, precision=p, compute_dtype=compute, train_attn=train_attn,
                eval_attn=eval_attn, eval_dtype=eval_dtype, eval_engine=choose_engine(cfg.eval.engine, eval_attn),
                attention_choice=why)
    strategy, choice = resolve_strategy(cfg, on_gpu=on_gpu, ranks=world_size(cfg, plan),
                                        free_mib=selection.planning_mib(),
                                        dtype_bytes=4 if compute == "float32" else 2)
    plan = plan.model_copy(update={"strategy": strategy, "strategy_choice": choice,
                                   **training_settings(cfg, plan.device, strategy)})
    # a chunk size this Liger cannot honour: refused here
    loss_chunk_setting(cfg, plan.liger, installed_version("liger-kernel"))
    if on_gpu and budget is not None and (short := budget_shortfall(cfg, plan)):
        raise EnvironmentMismatch([short], "config vs environment")
    if cfg.hardware.attn_implementation == "auto" and cfg.train.packing and plan.compile != "off":
        # the strategy decides whether training compiles its layers, which limits packed training's kernels
        train_attn, _, why, _ = resolve_attention("auto", env.attention, gpus, p, env.hub_reachable, timings,
                                                  packed=True, compiled=True)
        plan = plan.model_copy(update={"train_attn": train_attn,
                                       "attention_choice": {**plan.attention_choice, "train": why["train"]}})
    return plan


def budget_shortfall(cfg: FinetuneConfig, plan: Plan) -> str | None:
    """Why `hardware.memory_budget_gib` cannot train this model at all (None where it can, or where the model's shape
    cannot be read before it is fetched: the planner checks it then): the least a rank needs is its share of the
    base as loaded, the adapter with its gradients and optimizer state, and one `data.max_length` row with
    activation checkpointing, in the allocator's share of the budget (planner.allocator_bytes)."""
    shape = readable_model_shape(cfg.model.source, cfg.model.trust_remote_code)
    if shape is None:
        return None
    budget, tokens, four_bit = cfg.hardware.memory_budget_gib, cfg.data.max_length, cfg.quantization.load_in_4bit
    shards = world_size(cfg, plan) if plan.strategy == "fsdp" else 1
    parts = memory_parts(shape, tokens, checkpointing=True, four_bit=four_bit, lora_r=cfg.lora.r,
                         lora_targets=cfg.lora.target_modules, fused_ce=plan.liger,
                         loss_chunk_tokens=None if cfg.train.loss_chunk_tokens == "auto" else
                         cfg.train.loss_chunk_tokens,  # auto: none where they do not fit
                         dtype_bytes=4 if plan.compute_dtype == "float32" else 2, upcast=plan.upcast_frozen,
                         shards=shards)
    need = sum(parts.values())
    if need <= allocator_bytes(budget):
        return None
    gib = {k: f"{v / GIB:.1f} GiB" for k, v in parts.items()}
    weights = "the base weights (linear layers in 4 bits)" if four_bit else "the base weights"
    return (f"hardware.memory_budget_gib={budget:g} is too small for {cfg.model.source}: training it needs at least "
            f"{need / GIB:.1f} GiB per GPU ({gib['base']} for {weights}"
            + (f", sharded over {shards} ranks" if shards > 1 else "")
            + f", {gib['adapter']} for the LoRA adapter with its gradients and optimizer state, {gib['activations']} "
            f"for one {tokens}-token row (data.max_length) with activation checkpointing, {gib['reserve']} for the "
            f"allocator's slack and workspaces), beside {OUTSIDE_ALLOCATOR / GIB:.1f} GiB outside the allocator (the "
            f"CUDA context): set at least {math.ceil(10 * (need + OUTSIDE_ALLOCATOR) / GIB) / 10:.1f}, or null for the "
            "whole GPU")


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
    if env.attention_timings:
        lines += ["", "## Attention probes (auto)", "", "| backend | GPU | eval ms | padded train ms | packed train ms "
                  "| max rel diff vs sdpa | error |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {t.backend} | {t.gpu} | {t.eval_ms} | {t.train_ms} | {t.packed_train_ms} | {t.max_rel_diff} "
                  f"| {t.error or ''} |" for t in env.attention_timings]
    if env.kernels:
        lines += ["", "## Layer kernels (hardware.kernels)", "", "| layer | status |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in env.kernels.items()]
    lines += ["", "## Versions", "", "| package | version |", "|---|---|"]
    lines += [f"| {k} | {v or 'not installed'} |" for k, v in env.versions.items()]
    if plan is not None:
        lines += ["", "## Resolved plan", "", "| choice | value |", "|---|---|"]
        # the memory planner's part comes with the training step (the training-plan artifact)
        lines += [f"| {k} | {v} |" for k, v in plan.model_dump(exclude={"training"}).items()]
    return "\n".join(lines) + "\n"


PROBE_FORMAT = 1  # bump when probe() reports something new: older cached probes are then not reused


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no NVIDIA driver (or no pynvml): nothing to key on
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    finally:
        pynvml.nvmlShutdown()


def probe_key(kernels: dict[str, str] | None, gpus: list[GpuInfo]) -> str:
    """Everything the probe's answer depends on, read without importing torch: the interpreter, the installed
    versions of the stack, the platform, the driver, the GPUs (identity, not free memory) and the visible set."""
    ident = {"format": PROBE_FORMAT, "python": sys.executable, "version": sys.version, "host": socket.gethostname(),
             "platform": platform.platform(), "versions": {d: installed_version(d) for d in STACK},
             "driver": _driver_version() if gpus else None, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
             "gpus": [(g.index, g.uuid, g.name, g.memory_total_mib, g.mig) for g in gpus],
             "kernels": kernels or {}, "local_kernels": os.environ.get("LOCAL_KERNELS", "") if kernels else ""}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


# A store of machine probes for every cache on this host (e.g. one cache per team or project), instead of the run's
# cache: a probe describes the machine and the interpreter, not a cache.
PROBE_DIR_ENV = "FINETUNE_FLOWS_PROBE_DIR"
PROBES = "environment-probes"  # the probes' kind of store entry


def probe_dir(cache: Path | None) -> Path | None:
    """The store that keeps probes (as `<it>/environment-probes/<key>/`): $FINETUNE_FLOWS_PROBE_DIR, else the run's
    cache; None: not kept."""
    if cache is None:
        return None
    shared = os.environ.get(PROBE_DIR_ENV)
    return Path(shared).expanduser() if shared else cache


def run_probe(workdir: Path, kernels: dict[str, str] | None = None, cache: Path | None = None,
              gpus: list[GpuInfo] | None = None) -> EnvironmentReport:
    """The probe's report: a store entry (probe_dir) when this interpreter, stack and machine were probed before (a
    child that imports torch and bitsandbytes costs seconds per run), else from a new child. `gpus` is the run's
    reading of the inventory (read here when None), in the report either way; the Hub's reachability is read
    fresh."""
    gpus = read_inventory() if gpus is None else gpus

    def produce(_missing=None) -> list[EnvironmentReport]:
        job = write_job(workdir, "environment", kernels=kernels or {}, gpus=[g.model_dump(mode="json") for g in gpus])
        # CUDA_DEVICE_ORDER makes torch's numbering match nvidia-smi's, as for every worker.
        result = run_worker("environment", python_module("finetune_flows.runtime.environment", job),
                            {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, workdir)
        return [EnvironmentReport.model_validate(result)]

    store = probe_dir(cache)
    if store is None:
        return produce()[0]
    entry = Entry(store, PROBES, probe_key(kernels, gpus))
    ((report, reused),) = reuse_or_record([entry], EnvironmentReport, produce)
    if not reused:
        return report
    run_logger().info("environment: reusing the probe %s (same interpreter, stack versions and GPUs)", entry.path)
    return report.model_copy(update={"gpus": gpus, "hub_reachable": hub_reachable()})


def measured_plan(cfg: FinetuneConfig, env: EnvironmentReport, selection: GpuSelection,
                  workdir: Path) -> tuple[Plan, list[BackendTiming] | None]:
    """The plan, with `auto` attention settled by the usable backends' timings on the selected GPUs (measured in
    a worker, or from the cache), and those timings (None when nothing was measured)."""
    plan = resolve_plan(cfg, env, selection)
    if "auto" not in cfg.attention_settings().values():
        return plan, None
    try:
        timings = measured_timings(cfg, env.attention, env.versions, selection, plan.precision, plan.compute_dtype,
                                   workdir)
    except WorkerFailed as exc:  # a probe that crashes outright must not stop the run: sdpa is always there
        run_logger().warning("attention probe failed, evaluating and training with sdpa: %s", exc)
        return plan, None
    return (resolve_plan(cfg, env, selection, timings), timings) if timings else (plan, None)


def verify_environment(cfg: FinetuneConfig, run_dir: Path,
                       inventory: list[GpuInfo] | None = None) -> tuple[EnvironmentReport, Plan]:
    """Probe the machine, publish the report, and check the config against it (all problems at once).
    `inventory`: the flow run's one reading of the GPUs (read here where the caller has none)."""
    env = run_probe(run_dir / "work", cfg.hardware.kernels, cfg.cache_root, inventory)
    for layer, status in env.kernels.items():
        if not status.startswith("loads"):
            run_logger().warning("hardware.kernels %s: %s", layer, status)
    # the run's one reading of the GPUs: select_gpus computes the workers' selection from this same inventory
    selection = selection_for(cfg.hardware.gpus, env.gpus)  # names a missing or unusable GPU
    plan, timings = measured_plan(cfg, env, selection, run_dir / "work")
    if timings:
        env = env.model_copy(update={"attention_timings": timings})
    if cfg.hardware.memory_budget_gib is not None and plan.device != "cuda":
        run_logger().warning("hardware.memory_budget_gib=%g is ignored: this run trains on the CPU",
                             cfg.hardware.memory_budget_gib)
    if problems := plan_problems(cfg, plan):
        raise EnvironmentMismatch(problems, "config vs environment")
    md = report_markdown(env, plan)
    (run_dir / "environment.md").write_text(md)
    from prefect.artifacts import create_markdown_artifact  # here: the probe worker imports this module

    create_markdown_artifact(md, key="environment-report", description="Machine, stack and resolved plan")
    run_logger().info("plan: %s", plan.model_dump(exclude={"training"}))
    return env, plan


def _probe_job(job: dict) -> dict:
    return probe([GpuInfo.model_validate(g) for g in job["gpus"]], job.get("kernels")).model_dump(mode="json")


if __name__ == "__main__":
    worker_main(_probe_job)
