"""The training profile's summary (benchmarks/train_speed.py --profile): kernel time by category, and what the
host does while the GPU idles."""

from __future__ import annotations

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent, FunctionEventAvg

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


class _CudaProfile:
    """What a finished CUDA profile's key_averages() holds (no GPU here): kernels, a user annotation's GPU range
    around the optimizer's kernels, and the host's launch and synchronise calls."""

    def key_averages(self):
        def averaged(name, us, device, count=1, annotation=False):
            avg = FunctionEventAvg()
            for i in range(count):
                avg.add(FunctionEvent(id=i, name=name, thread=0, start_us=0, end_us=us, device_type=device,
                                      is_user_annotation=annotation, use_device="cuda"))
            return avg

        return [averaged("nvjet_sm90_tst_192x208_64x4_1x2_h_bz_coopB_TNT", 3_000, DeviceType.CUDA, count=100),
                averaged("void multi_tensor_apply_kernel<AdamW>", 10_000, DeviceType.CUDA, count=4),
                averaged("Optimizer.step#AdamW.step", 12_000, DeviceType.CUDA, annotation=True),
                averaged("cudaLaunchKernel", 80, DeviceType.CPU, count=104),
                averaged("cudaStreamSynchronize", 5_000, DeviceType.CPU, count=2)]


def test_kernels_are_summed_without_the_annotation_ranges_and_host_waits_are_counted():
    summary = summarize(_CudaProfile(), wall_seconds=0.8, steps=2)
    # 100 GEMMs of 3 ms and 4 optimizer kernels of 10 ms over 2 steps of 400 ms; the 12 ms annotation is no kernel
    assert summary["kernel_ms_per_step"] == {"gemm": 150.0, "optimizer": 20.0}
    assert summary["gpu_busy_ms_per_step"] == 170.0 and summary["gpu_idle_share"] == 0.575
    assert summary["kernels_per_step"] == 52 and summary["host_syncs_per_step"] == 1
    assert summary["top_host_ops_ms_per_step"] == [("cudaStreamSynchronize", 5.0), ("cudaLaunchKernel", 4.16)]
    assert categorize("Optimizer.step#AdamW.step") == "optimizer"


def test_the_training_report_shows_a_profiled_runs_kernels_and_host_side():
    import json

    from conftest import REPO, load_benchmark

    bench = load_benchmark("train_speed")
    report = json.loads((REPO / "benchmarks/results/train-bench-1xGPU-20261203-122342/report.json").read_text())
    run = next(r for r in report["runs"] if r["name"] == "ours-qwen3-8b-24gib")
    run["profile"] = summarize(_CudaProfile(), wall_seconds=0.8, steps=2)
    text = bench.markdown(report)
    assert "## Profile: ours-qwen3-8b-24gib (400.0 ms/step, GPU idle 57%)" in text
    assert "| gemm | 150.0 | 37.5% |" in text
    assert ("Per step: 52 kernels, 1 host-GPU synchronisations; the host's largest self times: "
            "cudaStreamSynchronize 5.0 ms, cudaLaunchKernel 4.16 ms") in text
