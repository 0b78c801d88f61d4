"""`make bench-train` end to end on the CPU with a tiny model: the seed recipe and the project's path, one report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_benchmark

pytestmark = pytest.mark.slow


def test_training_benchmark_smoke_run_writes_the_report(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "benchmarks/train_speed.py", "--smoke", "--state", str(tmp_path / "state"),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    names = {r["name"] for r in report["runs"]}
    assert names == {"seed-tiny-llama", "ours-tiny-llama"}
    for run in report["runs"]:
        for key in ("name", "model", "gpus", "tokens_per_second", "peak_reserved_gib", "mfu", "eval_loss"):
            assert key in run
        assert run["tokens_per_second"] > 0 and run["eval_loss"] > 0 and run["train_tokens"] > 0
    assert report["speedup"]["tiny-llama"] > 0
    assert abs(report["eval_loss_relative_to_seed"]["tiny-llama"]) < 0.05
    ours = next(r for r in report["runs"] if r["name"] == "ours-tiny-llama")
    assert ours["layout"].startswith("packed") and ours["training_plan"]["packing"]
    assert ours["attention_choice"] == "sdpa: CPU"  # the pipeline's own choice, as a flow run makes it
    for run in report["runs"]:  # the whole run's seconds, and what it took beyond its steady rate
        assert run["train_seconds"] > 0 and isinstance(run["warmup_overhead_seconds"], float)
        assert run["warmup_overhead_seconds"] < run["train_seconds"]
    assert 0 < ours["loss_curve"][-1][0] <= ours["steps"] and ours["grad_norms"] and ours["grad_norms"][0][1] > 0
    assert len(ours["step_seconds"]) == ours["steps"] and all(s > 0 for s in ours["step_seconds"])
    assert ours["alloc_retries"] is None  # no CUDA allocator here
    job = json.loads((tmp_path / "state" / "out" / "ours-tiny-llama" / "train.job.json").read_text())
    assert job["steady_warmup"] == 2  # the warm-up the seed's steady state leaves out (--smoke's)
    # compiled into the state's cache, as a flow run compiles into its store: a later call can carry it
    assert ours["training_plan"]["compile_layers"]
    assert any((tmp_path / "state" / "cache" / "compile" / "cpu" / "inductor").iterdir())
    assert "| seed-tiny-llama |" in (out / "report.md").read_text()
    # the host's CPU, and its speed after each row: rows bound by the host move with it
    assert report["cpu"]["cores"] >= 1 and all(run["host_dispatch_us"] > 0 for run in report["runs"])


def test_a_workload_cut_short_while_marking_itself_done_is_made_again(tmp_path, monkeypatch):
    """stats.json marks the workload done for every later call sharing --state: a write that fails before its end
    leaves no stats.json (and no temp file), so the next call writes the workload again instead of trusting half."""
    bench = load_benchmark("train_speed")

    def cut(fd):
        raise OSError("killed mid-write")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", cut)
        with pytest.raises(OSError, match="killed mid-write"):
            bench.write_workload(tmp_path, rows=20, vocab=64, smoke=True)
    assert not (tmp_path / "stats.json").exists() and not list(tmp_path.glob(".*.tmp"))
    stats = bench.write_workload(tmp_path, rows=20, vocab=64, smoke=True)
    assert json.loads((tmp_path / "stats.json").read_text()) == stats and stats["rows"] == 20


def test_the_layout_column_names_the_planners_switches_that_change_speed():
    bench = load_benchmark("train_report")
    plan = {"gradient_checkpointing": True, "dequantize_base": True, "fp8_base": False, "compile_layers": True}
    row = {"layout": "packed micro-batches of <= 10098 tokens x 1 accumulation", "training_plan": plan}
    assert bench._layout(row) == ("packed micro-batches of <= 10098 tokens x 1 accumulation; activation checkpointing; "
                                  "NF4 base dequantized; decoder layers compiled")
    row["compile_stats"] = {"frames_compiled": 3, "graph_breaks": 1, "cudagraph_skips": 0}
    assert bench._layout(row).endswith("3 frames compiled, 1 graph breaks, 0 CUDA graph recordings skipped")


def test_two_gpu_variants_get_their_own_scaling_beside_the_plain_one(tmp_path):
    """ours-2gpu-<shape> against ours-<shape> is `ddp_2gpu_scaling`; a `2gpu-<label>` variant is paired with the
    1-GPU variant of the same label under its own key, never overwriting the plain one."""
    from types import SimpleNamespace

    bench = load_benchmark("train_report")
    (tmp_path / "runs").mkdir()
    for name, speed in [("ours-qwen3-0.6b", 100.0), ("ours-2gpu-qwen3-0.6b", 190.0),
                        ("ours-noliger-qwen3-0.6b", 80.0), ("ours-2gpu-noliger-qwen3-0.6b", 120.0)]:
        (tmp_path / "runs" / f"{name}.json").write_text(json.dumps(
            {"name": name, "model": "generated:qwen3-0.6b", "tokens_per_second": speed}))
    env = SimpleNamespace(gpus=[], driver_version=None, cuda_version=None)
    speedup = bench.build_report(tmp_path, env, "cmd")["speedup"]
    assert speedup == {"ddp_2gpu_scaling": 1.9, "ddp_2gpu_scaling:noliger": 1.5}


def test_the_workload_never_emits_a_special_token_the_generated_models_pad_row_is_zero(tmp_path):
    """A row starting with the pad token keeps an all-zero hidden state through every layer of a generated model
    (its init zeroes the pad's embedding row), and the RMSNorms' backward then overflows bf16: the Qwen3-0.6B workload
    once held such a row and every GPU run that reached it went NaN. The chain now starts after the special ids."""
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from finetune_flows.models.sources import materialize_model, materialize_tokenizer

    bench = load_benchmark("train_speed")
    cache = tmp_path / "cache"
    data, stats = bench.workload_for("qwen3-0.6b", 300, tmp_path / "state", cache, smoke=False)
    special = set(AutoTokenizer.from_pretrained(materialize_tokenizer("generated:qwen3-0.6b", cache)).all_special_ids)
    ids = {t for split in ("train", "eval") for row in pq.read_table(data / f"{split}.parquet")["input_ids"].to_pylist()
           for t in row}
    assert special and not ids & special
    assert min(ids) == stats["first_id"] == max(special) + 1 and max(ids) < bench.CHAIN_VOCAB
    assert stats["median_length"] > 100  # the real length distribution, not the smoke one

    model = materialize_model("generated:tiny-llama", cache)
    tok = AutoTokenizer.from_pretrained(model)
    weights = load_file(next(model.glob("*.safetensors")))
    embed = next(w for name, w in weights.items() if name.endswith("embed_tokens.weight"))
    assert torch.count_nonzero(embed[tok.pad_token_id]) == 0 and tok.pad_token_id in special


def test_memory_poller_counts_the_runs_own_processes_not_memory_held_before_it_started(tmp_path, monkeypatch):
    """nvidia-smi's whole-GPU figure counted the benchmark's own 16 GiB (the 8B weights it had generated) against
    every run. The poller now sums only the processes that appeared on the run's GPUs after it started. A fake
    nvidia-smi stands in for the GPUs (there are none here): GPU 0 has the earlier process, GPU 1 someone else's."""
    bench = load_benchmark("train_speed")

    def put(path: Path, text: str) -> None:  # whole, at once: the poller's thread may read or run it meanwhile
        path.with_name(path.name + ".new").write_text(text)
        path.with_name(path.name + ".new").chmod(0o755)
        os.replace(path.with_name(path.name + ".new"), path)

    state = tmp_path / "apps"
    put(state, "100, /usr/bin/python3, GPU-a, 16380\n300, /usr/bin/python3, GPU-b, 9000\n")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    put(fake, f"""#!/bin/sh
case "$1" in
  --query-gpu=*) awk -F', ' '{{u[$3] += $4}} END {{printf "0, GPU-a, %d\\n1, GPU-b, %d\\n", u["GPU-a"], u["GPU-b"]}}' {state} ;;
  --query-compute-apps=*) cat {state} ;;
esac
""")
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    with bench.MemoryPoller([0]) as mem:
        put(state, "100, /usr/bin/python3, GPU-a, 16380\n200, /usr/bin/python3, GPU-a, 73936\n"
               "201, /usr/bin/torchrun, GPU-a, 500\n300, /usr/bin/python3, GPU-b, 9000\n")
        mem.sample()
        put(state, "100, /usr/bin/python3, GPU-a, 16380\n200, /usr/bin/python3, GPU-a, 40000\n")
        mem.sample()
    assert not mem.thread.is_alive()  # no late sample after the block: it would count against the next run
    assert mem.peak == 73936 + 500  # the run's two processes at their largest
    assert mem.device_peak == 16380 + 73936 + 500  # what nvidia-smi showed for GPU 0
    assert mem.processes == {"100 python3": 16380, "200 python3": 73936, "201 torchrun": 500}  # GPU 1's not here

    # Two GPUs: the busiest one's figure, not their sum (as the allocator's peak is the busiest rank's).
    put(state, "100, /usr/bin/python3, GPU-a, 16380\n")
    with bench.MemoryPoller([0, 1]) as both:
        put(state, "100, /usr/bin/python3, GPU-a, 16380\n200, /usr/bin/python3, GPU-a, 30000\n"
                   "300, /usr/bin/python3, GPU-b, 31000\n")
        both.sample()
    assert (both.peak, both.device_peak) == (31000, 16380 + 30000)

    # A container where nvidia-smi lists no processes: the GPU's figure less what it held when the run began.
    put(state, "")
    put(fake, f"""#!/bin/sh
case "$1" in
  --query-gpu=*) cat {tmp_path / 'gpus'} ;;
esac
""")
    put(tmp_path / "gpus", "0, GPU-a, 16380\n")
    with bench.MemoryPoller([0]) as blind:
        put(tmp_path / "gpus", "0, GPU-a, 90816\n")
        blind.sample()
    assert (blind.peak, blind.device_peak, blind.processes) == (90816 - 16380, 90816, {})


def test_a_variant_sets_config_keys_and_in_capitals_the_workers_environment_and_a_malformed_one_stops_first():
    bench = load_benchmark("train_speed")
    config, env = bench.split_overrides(["train.compile=false", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"])
    assert config == ["train.compile=false"]
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    proc = subprocess.run([sys.executable, "benchmarks/train_speed.py", "--variant", "x:NCCL_DEBUG"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--variant: 'NCCL_DEBUG' is not key=value" in proc.stderr
    assert "base model ready" not in proc.stdout  # nothing ran


def test_the_rows_of_a_shape_and_budget_in_the_order_asked_with_two_gpu_rows_skipped_on_one_gpu(capsys):
    """What each row runs: the seed, ours (and its profile), each peer once per batch size, then each variant; a row
    that needs two GPUs is skipped with a line on one."""
    from types import SimpleNamespace

    bench = load_benchmark("train_speed")
    calls = []
    runner = SimpleNamespace(gpu_ids=[0], run_seed=lambda *a: calls.append(("seed", *a)),
                             run_ours=lambda *a: calls.append(("ours", *a)),
                             run_peer=lambda *a: calls.append(("peer", *a)))
    args = SimpleNamespace(runs="seed,ours,ours-2gpu,unsloth", profile=True,
                           variant=["fp8:train.fp8_base=true,NCCL_DEBUG=INFO", "2gpu-x:train.compile=false"])
    jobs = bench.jobs_for(runner, args, "qwen3-8b", Path("data"), {}, 24, [8, 32])
    assert [(name, run, rows) for name, run, rows, _ in jobs] == [
        ("seed", "seed", None), ("ours", "ours", None), ("ours-profile", "ours", None),
        ("unsloth", "unsloth", 8), ("unsloth-r32", "unsloth", 32), ("ours-fp8", "ours-fp8", None)]
    assert "ours-2gpu skipped: 1 GPU(s) here" in capsys.readouterr().out
    for *_, job in jobs:
        job()
    shape = ("qwen3-8b", Path("data"), {})
    assert calls == [("seed", *shape, 24), ("ours", *shape, "ours", 1, [], False, 24),
                     ("ours", *shape, "ours-profile", 1, [], True, 24), ("peer", "unsloth", *shape, 24, 8),
                     ("peer", "unsloth", *shape, 24, 32),
                     ("ours", *shape, "ours-fp8", 1, ["train.fp8_base=true", "NCCL_DEBUG=INFO"], True, 24)]
