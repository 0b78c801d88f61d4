"""Attention backends: which ones can run on the *selected* GPUs, and which is fastest there, measured.

- `installed()` runs inside the environment probe (a child process): which backends this Python can import.
- `usable()` adds what the selected GPUs can run: every selected GPU must have the compute capability a
  backend needs (a mixed host is only as capable as its weakest selected GPU), and flash kernels need fp16/bf16.
- `measure_on_device()` runs in a child process on the selected GPUs: for each usable backend, a short timing
  probe on a one-layer model with the run's attention shape (heads, KV heads, head dim, dtype): an
  evaluation-like padded forward, a padded forward+backward, and a forward+backward over packed rows through the
  variable-length kernel that packed training calls for that backend (models/attention.py), on fresh packed
  layouts, each checked against sdpa on the same inputs. Results are store entries per GPU model and software
  versions (`<cache>/attention-probes/<key>/`, store/entries.py), so a host measures once.
- `resolve_attention()` turns `hardware.attn_implementation` into one backend for training and one for
  evaluation (`eval.attn_implementation`, where set, decides evaluation's alone): `auto` is the fastest correct
  backend for each purpose (for training, on the path it runs: packed or padded; packed through compiled layers,
  only the kernels the compiler traces), kept at sdpa unless another is faster by more than SWITCH_MARGIN (sdpa
  on the CPU, or when nothing else is usable); an explicit name is checked against the selected GPUs.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from pydantic import BaseModel

from finetune_flows.config.schema import ATTENTION_BACKENDS, FinetuneConfig
from finetune_flows.store.entries import Entry, reuse_or_record
from finetune_flows.store.fingerprint import code_version
from finetune_flows.runtime.gpus import GpuInfo, GpuSelection
from finetune_flows.runtime.launcher import compile_caches, python_module, run_worker, write_job
from finetune_flows.runtime.lifecycle import worker_main
from finetune_flows.models.kernels import local_kernel_repo
from finetune_flows.models.sources import readable_shape
from finetune_flows.models.attention import packed_kernel_for, use_packed_attention

# Backend -> (distribution to install, test on one GPU's capability, what that test demands).
REQUIREMENTS = {
    "flash_attention_2": ("flash-attn", lambda cc: cc >= (8, 0), "compute capability >= 8.0"),
    "flash_attention_3": ("flash-attn-3", lambda cc: cc[0] == 9, "Hopper (sm_90)"),
    "flash_attention_4": ("flash-attn-4", lambda cc: cc[0] in (9, 10), "Hopper or Blackwell (sm_90/sm_100)"),
    "flex_attention": ("triton", lambda cc: cc >= (7, 0), "compute capability >= 7.0"),
}
# flex_attention is never chosen by `auto`: transformers compiles it (max-autotune, static shapes) for every new
# input shape, and evaluation batches and packed training rows change shape all the time. Set it explicitly.
AUTO_CANDIDATES = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
TOLERANCE = 2e-2  # max |out - sdpa out| / max |sdpa out| for a backend to count as correct (bf16 kernels)
# A backend other than sdpa must beat it by more than this to be chosen: more than two runs of one engine differ,
# and a switch is not free (a slower first step, and a probe that can rank backends otherwise than whole-model
# training does). The figures: benchmarks/results/train-bench-1xGPU-20261201-142917/NOTE.md.
SWITCH_MARGIN = 0.05
# Where training compiles its decoder layers (train.compile), torch.compile traces only torch's own varlen kernel
# (sdpa's packed path) into each layer's graph; a flash kernel runs as an untraced call between two compiled pieces
# of every layer (models/attention.py). The probe times one small eager layer, so it cannot see that cost, and
# compiled training on a flash kernel the probe ranked first ran slower than on torch's varlen (the same NOTE.md).
# So compiled packed training stays on the traced kernel; the probe's packed timing decides where it is not compiled.
COMPILE_TRACED_PACKED = ("sdpa",)


class BackendTiming(BaseModel):
    backend: str
    gpu: str  # "<name> (sm_XY)"
    eval_ms: float | None = None  # forward of a padded batch (prefill-like)
    train_ms: float | None = None  # forward + backward of that padded batch (training with train.packing=false)
    packed_train_ms: float | None = None  # forward + backward over packed rows, varlen kernel (train.packing=true)
    max_rel_diff: float | None = None  # against sdpa's output on the same inputs (padded and packed, the worse)
    error: str | None = None

    @property
    def correct(self) -> bool:
        return self.error is None and self.max_rel_diff is not None and self.max_rel_diff <= TOLERANCE


def installed(cuda: bool, versions: dict[str, str | None]) -> dict[str, str]:
    """Backend -> "available" (importable here) or why not. GPU capability is judged later, per selection."""
    from transformers.utils import import_utils as iu

    out = {"eager": "available", "sdpa": "available"}
    checks = {"flash_attention_2": iu.is_flash_attn_2_available, "flash_attention_3": iu.is_flash_attn_3_available,
              "flash_attention_4": iu.is_flash_attn_4_available,
              "flex_attention": lambda: iu.is_torch_flex_attn_available() and bool(versions.get("triton"))}
    for name, check in checks.items():
        dist = REQUIREMENTS[name][0]
        if not cuda:
            out[name] = "needs a CUDA GPU"
        elif check():
            out[name] = "available"
        else:
            out[name] = f"{dist} not installed" if not versions.get(dist) else f"{dist} {versions[dist]} not usable"
    out["hub_kernels"] = "available" if iu.is_kernels_available() else (
        "kernels not installed" if not versions.get("kernels") else f"kernels {versions['kernels']} not accepted "
        f"by transformers {versions.get('transformers')}"
    )
    return out


def usable(backend: str, attention: dict[str, str], gpus: list[GpuInfo], precision: str) -> str | None:
    """None when `backend` can run on every selected GPU at this precision, else the reason (naming the GPU)."""
    if backend in ("eager", "sdpa"):
        return None
    if backend not in REQUIREMENTS:  # a Hub kernel id
        return None if attention.get("hub_kernels") == "available" else f"needs Hub kernels: {attention['hub_kernels']}"
    if attention.get(backend) != "available":
        return attention.get(backend, "unknown backend")
    if not gpus:
        return "needs a CUDA GPU"
    _, test, demand = REQUIREMENTS[backend]
    for g in gpus:
        if not test(g.capability):
            return (f"GPU {g.index} ({g.name}, compute capability {g.capability[0]}.{g.capability[1]}) cannot run "
                    f"it: needs {demand}")
    if backend.startswith("flash_attention") and precision == "fp32":
        return "needs fp16 or bf16, but precision is fp32"
    return None


def candidates(attention: dict[str, str], gpus: list[GpuInfo], precision: str) -> list[str]:
    return [b for b in AUTO_CANDIDATES if usable(b, attention, gpus, precision) is None]


def choose(timings: list[BackendTiming], names: list[str], purpose: str, packed: bool = True,
           compiled: bool = False) -> tuple[str, str]:
    """The backend with the lowest worst-case time over the measured GPU models, and why (sdpa if none won, or
    if the winner is not faster than sdpa by more than SWITCH_MARGIN). Training is judged on the path it runs:
    packed rows through a varlen kernel, or padded batches; packed rows through compiled decoder layers
    (`compiled`) only among the kernels the compiler traces (COMPILE_TRACED_PACKED)."""
    if purpose == "train" and packed and compiled:
        untraced = [n for n in names if n not in COMPILE_TRACED_PACKED]
        names = [n for n in names if n in COMPILE_TRACED_PACKED]
        best, why = choose(timings, names, purpose, packed)
        if untraced:
            why += (f"; not {', '.join(untraced)}: compiled decoder layers call them untraced (slower in "
                    "whole-model training than this eager probe shows: finetune_flows/models/backends.py)")
        return best, why
    key = "eval_ms" if purpose == "eval" else ("packed_train_ms" if packed else "train_ms")
    label = "eval" if purpose == "eval" else ("packed train" if packed else "padded train")
    worst: dict[str, float] = {}
    for name in names:
        rows = [t for t in timings if t.backend == name]
        if rows and all(t.correct and getattr(t, key) is not None for t in rows):
            worst[name] = max(getattr(t, key) for t in rows)
    if not worst:
        return "sdpa", "no backend measured correct and faster; sdpa"
    best = min(worst, key=worst.get)
    ranking = ", ".join(f"{n} {worst[n]:.2f} ms" for n in sorted(worst, key=worst.get))
    if best != "sdpa" and "sdpa" in worst and worst[best] > worst["sdpa"] * (1 - SWITCH_MARGIN):
        return "sdpa", (f"fastest measured for {label}: {ranking}; {best} is within {SWITCH_MARGIN:.0%} of sdpa, "
                        "so sdpa")
    return best, f"fastest measured for {label}: {ranking}"


def resolve_attention(want: str, attention: dict[str, str], gpus: list[GpuInfo], precision: str,
                      hub_reachable: bool, timings: list[BackendTiming] | None,
                      key: str = "hardware.attn_implementation", packed: bool = True,
                      compiled: bool = False) -> tuple[str, str, dict, list[str]]:
    """(train backend, eval backend, why, problems) for the attention setting `key` (problems name it); `packed`:
    whether training packs rows (train.packing), which decides the training timing `auto` compares; `compiled`:
    whether training compiles its decoder layers (train.compile), which limits packed training to traced kernels."""
    if want == "auto":
        names = candidates(attention, gpus, precision) if gpus else ["sdpa"]
        if names == ["sdpa"]:
            why = "the only usable backend here" if gpus else "CPU"
            return "sdpa", "sdpa", {"train": why, "eval": why}, []
        if not timings:
            why = f"usable {names} not measured; sdpa"
            return "sdpa", "sdpa", {"train": why, "eval": why}, []
        train, train_why = choose(timings, names, "train", packed, compiled)
        evaluation, eval_why = choose(timings, names, "eval")
        return train, evaluation, {"train": train_why, "eval": eval_why}, []
    problems = []
    reason = usable(want, attention, gpus, precision)
    if reason:
        problems.append(f"{key}={want} cannot run here: {reason}")
    if want not in ATTENTION_BACKENDS and want not in REQUIREMENTS and not hub_reachable and reason is None:
        if local_kernel_repo(want) is None:
            problems.append(f"{key}={want} needs the Hub kernel repo, but the Hub is unreachable and LOCAL_KERNELS "
                            "has no copy of it")
    return want, want, {"train": "configured", "eval": "configured"}, problems


# ---------------------------------------------------------------- measurement (in a child process on the GPUs)


def attention_shape(cfg: FinetuneConfig) -> dict:
    """Heads, KV heads and head dim of the run's model where its config can be read without loading it."""
    shape = readable_shape(cfg.model.source, cfg.model.trust_remote_code)
    if shape is None:  # a built-in or Hub model not materialized yet: a common small-model shape
        shape = readable_shape("generated:qwen3-0.6b")
    return {"heads": shape["num_attention_heads"], "kv_heads": shape["num_key_value_heads"],
            "head_dim": shape["head_dim"]}


def probe_key(gpu_name: str, capability: tuple[int, int], versions: dict, shape: dict, dtype: str) -> str:
    parts = [gpu_name, list(capability), versions, shape, dtype, code_version("models/backends")]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


class AttentionProbe(BaseModel):
    """The timings of one GPU model, as its store entry holds them."""

    timings: list[BackendTiming]


def measured_timings(cfg: FinetuneConfig, attention: dict[str, str], versions: dict, selection: GpuSelection,
                     precision: str, compute_dtype: str, workdir: Path) -> list[BackendTiming] | None:
    """Timings of every usable backend on each distinct GPU model among the selected ones, from the store or
    measured now in one worker; None when there is nothing to choose between (CPU, or sdpa alone)."""
    names = candidates(attention, selection.gpus, precision)
    if not selection.gpus or names == ["sdpa"]:
        return None
    shape = attention_shape(cfg)
    kinds = {}  # (name, capability) -> first selected position of that kind (its cuda:N in the worker)
    for position, g in enumerate(selection.gpus):
        kinds.setdefault((g.name, tuple(g.capability)), position)
    position = {probe_key(name, cc, versions, shape, compute_dtype): at for (name, cc), at in kinds.items()}
    entries = [Entry(cfg.cache_root, "attention-probes", key) for key in position]

    def produce(missing: list[Entry]) -> list[AttentionProbe]:
        job = write_job(workdir, "attention-probe", names=names, shape=shape, dtype=compute_dtype,
                        devices={e.key: position[e.key] for e in missing})
        result = run_worker("attention-probe", python_module("finetune_flows.models.backends", job),
                            {**selection.env, **compile_caches(cfg.cache_root, selection)}, workdir)
        return [AttentionProbe(timings=result[e.key]) for e in missing]

    return [t for probe, _ in reuse_or_record(entries, AttentionProbe, produce) for t in probe.timings]


def _probe_model(backend: str, shape: dict, dtype, device):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=shape["heads"] * shape["head_dim"], intermediate_size=256,
                                  num_hidden_layers=1, num_attention_heads=shape["heads"],
                                  num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], vocab_size=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=backend).to(device)
    return model


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeats: int = 5, windows: int = 5) -> float:
    """ms per call: the median of `windows` timed windows of `repeats` calls, after one warm-up call (one window
    is too noisy to rank backends by)."""
    import statistics

    fn()
    _sync(device)
    per_window = []
    for _ in range(windows):
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        _sync(device)
        per_window.append((time.perf_counter() - started) / repeats * 1000)
    return statistics.median(per_window)


def packed_layouts(count: int, budget: int = 8192, seed: int = 0) -> list[list[int]]:
    """`count` packings of row lengths as training sees them (lognormal, median 256, 32..1024), each exactly
    `budget` tokens (its last row cut to fit): the cumulative boundaries (cu_seqlens) of one packed micro-batch."""
    import math
    import random

    rng = random.Random(seed)
    layouts = []
    for _ in range(count):
        cu = [0]
        while cu[-1] < budget:
            n = min(1024, max(32, round(rng.lognormvariate(math.log(256), 0.7))))
            cu.append(min(budget, cu[-1] + n))
        layouts.append(cu)
    return layouts


def _packed_inputs(cu: list[int], device) -> dict:
    import torch

    g = torch.Generator().manual_seed(len(cu))
    positions = [p for a, b in zip(cu, cu[1:]) for p in range(b - a)]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    return {"input_ids": torch.randint(0, 256, (1, cu[-1]), generator=g).to(device),
            "position_ids": torch.tensor([positions], device=device), "cu_seq_lens_q": cu_t, "cu_seq_lens_k": cu_t,
            "max_length_q": longest, "max_length_k": longest}


def _time_packed(model, layouts: list[dict], device) -> float:
    """ms per forward+backward over packed rows: the first layout warms up (one-time kernel compilation), the
    others are new shapes, as training's micro-batches are, so a kernel that recompiles per shape pays for it."""

    def step(inputs):
        model.model(**inputs).last_hidden_state.float().pow(2).mean().backward()

    step(layouts[0])
    _sync(device)
    started = time.perf_counter()
    for inputs in layouts[1:]:
        step(inputs)
    _sync(device)
    return (time.perf_counter() - started) / (len(layouts) - 1) * 1000


def measure_on_device(device_index: int | str, names: list[str], shape: dict, dtype_name: str,
                      batch: int = 16, length: int = 512, layouts: int = 6) -> list[BackendTiming]:
    """Time each backend on one GPU (inside a worker): a padded prefill-like forward, a padded forward+backward,
    and a packed forward+backward through the varlen kernel packed training calls for the backend. An int is
    a CUDA device index; "cpu" runs the same code on the CPU (sdpa and the exact per-row kernel only)."""
    import torch

    device = torch.device("cuda", device_index) if isinstance(device_index, int) else torch.device(device_index)
    dtype = getattr(torch, dtype_name)
    on_gpu = device.type == "cuda"
    gpu = (f"{torch.cuda.get_device_name(device)} (sm_{''.join(map(str, torch.cuda.get_device_capability(device)))})"
           if on_gpu else "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch, length), generator=g).to(device)
    mask = torch.ones_like(ids)
    for r in range(batch):  # varied lengths, as in real batches (left padding, like generation)
        mask[r, : (r * length) // (2 * batch)] = 0
    packed = [_packed_inputs(cu, device) for cu in packed_layouts(layouts)]
    reference = packed_reference = None
    out = []

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))

    for name in ["sdpa", *[n for n in names if n != "sdpa"]]:
        row = BackendTiming(backend=name, gpu=gpu)
        try:
            model = _probe_model(name, shape, dtype, device)
            with torch.no_grad():
                hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state.float() * mask[..., None]
            reference = hidden if name == "sdpa" else reference
            row.max_rel_diff = rel(hidden, reference)
            with torch.no_grad():
                row.eval_ms = round(_time(lambda: model.model(input_ids=ids, attention_mask=mask), device), 3)
            model.train()
            row.train_ms = round(_time(lambda: model.model(input_ids=ids, attention_mask=mask)
                                       .last_hidden_state.float().pow(2).mean().backward(), device), 3)
            if name == "sdpa":  # the reference for packed rows: each row of the first layout run alone
                cu, ids0 = packed[0]["cu_seq_lens_q"].tolist(), packed[0]["input_ids"]
                with torch.no_grad():
                    packed_reference = torch.cat([model.model(input_ids=ids0[:, a:b]).last_hidden_state.float()
                                                  for a, b in zip(cu, cu[1:])], dim=1)
            use_packed_attention(model, packed_kernel_for(name, on_gpu))
            with torch.no_grad():
                row.max_rel_diff = max(row.max_rel_diff, rel(model.model(**packed[0]).last_hidden_state.float(),
                                                             packed_reference))
            row.packed_train_ms = round(_time_packed(model, packed, device), 3)
        except Exception as exc:  # a backend that fails here is simply not chosen; the reason is reported
            row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        out.append(row)
        if on_gpu:
            torch.cuda.empty_cache()
    return out


def _probe_job(job: dict) -> dict:
    return {key: [t.model_dump() for t in measure_on_device(position, job["names"], job["shape"], job["dtype"])]
            for key, position in job["devices"].items()}


if __name__ == "__main__":
    worker_main(_probe_job)
