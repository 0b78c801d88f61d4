"""Where a training step's time goes: a short torch.profiler window, kernels grouped by what they do.

Used by the training benchmark (`benchmarks/train_speed.py --profile`) through the job field `profile`: steps
`start..start+steps` are recorded, the CUDA kernels' self time is summed per category (attention, GEMM,
4-bit dequantization, cross-entropy, normalisation/elementwise, optimizer, communication, other), and the share of
wall time the GPU was idle (launch overhead, Python, data loading) is what is left; the gaps between kernels are
charged to the host op that launched the kernel after each (`idle_gaps`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CATEGORIES = [  # first match wins
    ("attention", r"flash|fmha|attention|varlen|sdpa|softmax.*fwd|_attn"),
    ("dequantize", r"dequant|kdequant|kQuantize|4bit|nf4|gemv_4bit"),
    ("cross_entropy", r"cross_entropy|liger.*ce|log_softmax|nll_loss"),
    ("gemm", r"gemm|xmma|cutlass|matmul|sm90_|sm80_|cublas|wgmma|nvjet"),
    ("communication", r"nccl|allreduce|all_reduce|broadcast"),
    ("optimizer", r"adam|multi_tensor|foreach|optim"),
    ("norm_rope_act", r"rms|norm|rope|rotary|silu|swiglu|gelu|liger"),
    ("elementwise_copy", r"elementwise|vectorized|copy|cast|fill|cat|index|reduce|memcpy|memset|where|mul|add"),
]


def categorize(name: str) -> str:
    low = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, low):
            return category
    return "other"


SYNC = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$")  # the host waits for the GPU here


def _on_device(evt) -> bool:
    return getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type)


# the host calls that put work on the GPU: the last one before a kernel that starts on an idle GPU launched it
LAUNCH = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchKernelEx|LaunchKernelExC|LaunchCooperativeKernel|GraphLaunch|"
                    r"MemcpyAsync|MemsetAsync|Memcpy|Memset)(_v\d+)?$")


def _launcher_name(launch) -> str:
    """`outermost op > op that made the launch call`, e.g. `Optimizer.step#AdamW.step > aten::_foreach_mul_`."""
    op = launch.cpu_parent or launch
    outer = op
    while outer.cpu_parent is not None:
        outer = outer.cpu_parent
    return (op.name if outer is op else f"{outer.name} > {op.name}")[:120]


def idle_gaps(events, steps: int, top: int = 12) -> dict:
    """Where the GPU waits between kernels: each gap (no kernel running on any stream) is charged to the host op
    whose launch call started the kernel after it: the last launch call (cudaLaunchKernel and kin) the host made
    before that kernel began, named with its enclosing ops (`Optimizer.step#AdamW.step > aten::_foreach_mul_`). The
    host was busy with that op, or with what preceded it, while the GPU had nothing to run. Matched by time: the
    kernels' correlation ids need not name their launching ops. `events`: a finished profiler's `events()`."""
    import bisect

    launches = sorted((e for e in events if not _on_device(e) and LAUNCH.match(e.name)),
                      key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in launches]
    kernels = sorted((e for e in events if _on_device(e) and not getattr(e, "is_user_annotation", False)),
                     key=lambda e: e.time_range.start)
    by_launcher: dict[str, float] = {}
    gaps, large = 0.0, 0
    busy_until = None
    for k in kernels:
        if busy_until is not None and k.time_range.start > busy_until:
            gap = (k.time_range.start - busy_until) / 1e3
            gaps += gap
            large += gap >= 0.05
            i = bisect.bisect_right(starts, k.time_range.start) - 1
            name = _launcher_name(launches[i]) if i >= 0 else "?"
            by_launcher[name] = by_launcher.get(name, 0.0) + gap
        busy_until = k.time_range.end if busy_until is None else max(busy_until, k.time_range.end)
    return {"gap_ms_per_step": round(gaps / steps, 2), "gaps_of_50us_or_more_per_step": round(large / steps, 1),
            "gap_ms_per_step_by_next_launch": [(n, round(ms / steps, 3))
                                               for n, ms in sorted(by_launcher.items(), key=lambda kv: -kv[1])[:top]]}


def summarize(prof, wall_seconds: float, steps: int) -> dict:
    """Kernel time per category (ms per step) and the GPU-idle remainder, from a finished profiler; and on the
    host side, what an idle GPU waits on: kernel launches and host-device synchronisations per step, and the ops
    with the most self CPU time. A user annotation's GPU range (`Optimizer.step#AdamW.step`) spans kernels that
    are counted themselves, so it is left out of the kernel time."""
    kernels: dict[str, float] = {}
    launches = 0
    host: dict[str, float] = {}
    syncs = 0
    for evt in prof.key_averages():
        on_device = getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type)
        if not on_device:
            host[evt.key] = host.get(evt.key, 0.0) + getattr(evt, "self_cpu_time_total", 0) / 1e3
            syncs += evt.count if SYNC.search(evt.key) else 0
            continue
        if getattr(evt, "is_user_annotation", False):
            continue
        device_us = getattr(evt, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(evt, "self_cuda_time_total", 0)
        if device_us:
            kernels[evt.key] = kernels.get(evt.key, 0.0) + device_us / 1e3
            launches += evt.count
    by_cat: dict[str, float] = {}
    for name, ms in kernels.items():
        by_cat[categorize(name)] = by_cat.get(categorize(name), 0.0) + ms
    wall_ms = wall_seconds * 1e3
    gaps = idle_gaps(prof.events(), steps) if launches else {}
    busy = sum(by_cat.values())
    per_step = {k: round(v / steps, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"steps": steps, "wall_ms_per_step": round(wall_ms / steps, 2),
            "kernel_ms_per_step": per_step, "gpu_busy_ms_per_step": round(busy / steps, 2),
            "gpu_idle_share": round(max(0.0, 1 - busy / wall_ms), 3) if wall_ms else None,
            "share_of_wall": {k: round(v / wall_ms, 3) for k, v in by_cat.items()} if wall_ms else {},
            "top_kernels_ms_per_step": [(n[:120], round(ms / steps, 3)) for n, ms in top],
            "kernels_per_step": round(launches / steps, 1), "host_syncs_per_step": round(syncs / steps, 1),
            "top_host_ops_ms_per_step": [(n[:120], round(ms / steps, 3))
                                         for n, ms in sorted(host.items(), key=lambda kv: -kv[1])[:15]],
            **gaps}


def profiler_callback(path: Path, start: int, steps: int, exclude=None):
    """A TrainerCallback that profiles optimizer steps start+1 .. start+steps and writes the summary to `path`.
    `exclude` (the step clock's) leaves those steps, and the next one, which holds the summary, out of the steady
    state: the profiler slows the host."""
    import time

    import torch
    from transformers import TrainerCallback

    class Profile(TrainerCallback):
        def __init__(self):
            self.prof = None
            self.t0 = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            if exclude is not None and start <= state.global_step <= start + steps:
                exclude()  # the next step's interval
            if state.global_step == start and self.prof is None:
                torch.cuda.synchronize()
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
                self.prof.__enter__()
                self.t0 = time.perf_counter()
            elif self.prof is not None and state.global_step == start + steps:
                torch.cuda.synchronize()
                wall = time.perf_counter() - self.t0
                self.prof.__exit__(None, None, None)
                if state.is_world_process_zero:
                    Path(path).write_text(json.dumps(summarize(self.prof, wall, steps), indent=2))
                self.prof = None

    return Profile()
