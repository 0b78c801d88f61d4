"""The training profile's summary (benchmarks/train_speed.py --profile): kernel time by category, and what the
host does while the GPU idles."""

from __future__ import annotations

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from finetune_flows.training.profiling import categorize, summarize


def test_a_real_cpu_profile_of_training_steps_lists_the_host_ops_and_no_kernels():
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            model(torch.randn(32, 64)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    summary = summarize(prof, wall_seconds=0.5, steps=2)
    names = [name for name, _ in summary["top_host_ops_ms_per_step"]]
    assert any(name in ("aten::addmm", "aten::mm", "aten::linear") for name in names), names
    assert all(ms >= 0 for _, ms in summary["top_host_ops_ms_per_step"])
    assert summary["kernel_ms_per_step"] == {} and summary["kernels_per_step"] == 0
    assert summary["gpu_idle_share"] == 1.0 and summary["host_syncs_per_step"] == 0


def _event(id, name, start, end, device=DeviceType.CPU, launcher=0, annotation=False):
    return FunctionEvent(id=id, name=name, thread=1, start_us=start, end_us=end, device_type=device,
                         is_user_annotation=annotation, use_device="cuda", linked_correlation_id=launcher,
                         stack=[], input_shapes=[])


class _CudaProfile:
    """What a finished CUDA profile holds (none can exist here), two steps of 400 ms in all: 101 GEMMs of 3 ms
    launched by aten::mm, on two streams that overlap; a 99 ms gap, then 4 optimizer kernels of 10 ms launched under
    the `Optimizer.step` annotation (whose GPU range spans them) 20 us apart; a last GEMM 40 us after them, launched
    by another aten::mm; and the host's launch and synchronise calls."""

    def __init__(self):
        cpu = [_event(1, "aten::mm", 0, 40), _event(2, "Optimizer.step#AdamW.step", 249_000, 249_500, annotation=True),
               _event(3, "aten::_foreach_mul_", 249_100, 249_200), _event(4, "cudaStreamSynchronize", 300_000, 305_000),
               _event(5, "cudaStreamSynchronize", 700_000, 705_000), _event(6, "cudaLaunchKernel", 249_150, 249_180),
               _event(7, "aten::mm", 290_000, 290_090), _event(8, "cudaLaunchKernel", 290_050, 290_080),
               _event(9, "Buffer Flush", 0, 1)]  # kernels' correlation ids may point here: gaps are matched by time
        cpu += [_event(100 + i, "cudaLaunchKernel", 1_000 + i * 100, 1_080 + i * 100) for i in range(105)]
        gemm = "nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT"
        kernels = [_event(1000 + i, gemm, i * 3_000, i * 3_000 + 3_000, DeviceType.CUDA, 9) for i in range(50)]
        kernels += [_event(1100 + i, gemm, i * 3_000 + 1_000, i * 3_000 + 4_000, DeviceType.CUDA, 9)
                    for i in range(50)]  # ends at 151 ms
        kernels += [_event(1200 + i, "void multi_tensor_apply_kernel<AdamW>", 250_000 + i * 10_020,
                           260_000 + i * 10_020, DeviceType.CUDA, 9) for i in range(4)]  # ends at 290.06 ms
        kernels += [_event(1300, gemm, 290_100, 293_100, DeviceType.CUDA, 9)]
        annotation = _event(1400, "Optimizer.step#AdamW.step", 250_000, 290_060, DeviceType.CUDA, 2, annotation=True)
        self._events = EventList(cpu + kernels + [annotation])
        self._events._build_tree()

    def events(self):
        return self._events

    def key_averages(self):
        return self._events.key_averages()


def test_kernels_are_summed_without_the_annotation_ranges_and_host_waits_and_gaps_are_counted():
    summary = summarize(_CudaProfile(), wall_seconds=0.8, steps=2)
    assert summary["kernel_ms_per_step"] == {"gemm": 151.5, "optimizer": 20.0}  # not the annotation's 40 ms
    assert summary["gpu_busy_ms_per_step"] == 171.5 and summary["gpu_idle_share"] == 0.571
    assert summary["kernels_per_step"] == 52.5 and summary["host_syncs_per_step"] == 1
    assert summary["top_host_ops_ms_per_step"][:2] == [("cudaStreamSynchronize", 5.0), ("cudaLaunchKernel", 4.23)]
    # the gaps: 99 ms + 3 x 20 us before optimizer kernels, 40 us before the last GEMM; the overlap is no gap
    assert summary["gap_ms_per_step"] == 49.55 and summary["gaps_of_50us_or_more_per_step"] == 0.5
    assert summary["gap_ms_per_step_by_next_launch"] == [("Optimizer.step#AdamW.step > aten::_foreach_mul_", 49.53),
                                                         ("aten::mm", 0.02)]
    assert categorize("Optimizer.step#AdamW.step") == "optimizer"


def test_the_training_report_shows_a_profiled_runs_kernels_and_host_side():
    import json

    from conftest import REPO, load_benchmark

    bench = load_benchmark("train_report")
    report = json.loads((REPO / "benchmarks/results/train-bench-1xGPU-20261203-122342/report.json").read_text())
    run = next(r for r in report["runs"] if r["name"] == "ours-qwen3-8b-24gib")
    run["profile"] = summarize(_CudaProfile(), wall_seconds=0.8, steps=2)
    text = bench.markdown(report)
    assert "## Profile: ours-qwen3-8b-24gib (400.0 ms/step, GPU idle 57%)" in text
    assert "| gemm | 151.5 | 37.9% |" in text
    assert ("Per step: 52.5 kernels, 1 host-GPU synchronisations; the host's largest self times: "
            "cudaStreamSynchronize 5.0 ms, cudaLaunchKernel 4.23 ms") in text
    assert ("GPU idle between kernels 49.55 ms per step (0.5 gaps of 50 us or more), before kernels launched by: "
            "Optimizer.step#AdamW.step > aten::_foreach_mul_ 49.53 ms, aten::mm 0.02 ms") in text


def test_the_profiled_steps_and_the_one_holding_the_summary_are_left_out_of_the_steady_state(tmp_path, monkeypatch):
    """The profiler slows the host: the callback excludes (in the step clock) steps start+1..start+steps and the
    step after them, in which the summary is written (CUDA and the profiler stood in for: no GPU here)."""
    from types import SimpleNamespace

    import finetune_flows.training.profiling as profiling

    class Profile:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(profiling, "summarize", lambda prof, wall, steps: {"steps": steps})
    excluded_after = []
    callback = profiling.profiler_callback(tmp_path / "profile.json", start=3, steps=2,
                                           exclude=lambda: excluded_after.append(state.global_step))
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    for step in range(1, 9):
        state.global_step = step
        callback.on_step_end(None, state, None)
    assert excluded_after == [3, 4, 5]  # so the intervals of steps 4, 5 (profiled) and 6 (the summary) are left out
    assert (tmp_path / "profile.json").read_text().strip().startswith("{")
