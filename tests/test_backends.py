"""Attention backends (finetune_flows/models/backends.py) on injected GPU inventories: what the *selected* GPUs can run,
and `auto` as the fastest correct backend measured on them, for training and evaluation separately."""

from __future__ import annotations

import json

import pytest

from finetune_flows.models.backends import (
    AttentionProbe, BackendTiming, candidates, measured_timings, probe_key, resolve_attention, usable,
)
from finetune_flows.config.schema import load_config
from finetune_flows.runtime.environment import resolve_plan
from finetune_flows.errors import ConfigError, EnvironmentMismatch
from finetune_flows.runtime.gpus import selection_for
from finetune_flows.store.entries import Entry, reuse_or_record
from test_gpus import gpu, report

H100 = gpu(0, 80000, name="NVIDIA H100", cc=(9, 0))
A100 = gpu(1, 80000, name="NVIDIA A100", cc=(8, 0))
T4 = gpu(2, 15000, name="Tesla T4", cc=(7, 5))
INSTALLED = {"eager": "available", "sdpa": "available", "flash_attention_2": "available",
             "flash_attention_3": "available", "flash_attention_4": "available",
             "flex_attention": "available", "hub_kernels": "kernels not installed"}


def timing(backend, eval_ms, train_ms, gpu_name="NVIDIA H100 (sm_90)", diff=1e-3, error=None, packed_ms="same"):
    """A probe row; the packed training time is the padded one unless given."""
    return BackendTiming(backend=backend, gpu=gpu_name, eval_ms=eval_ms, train_ms=train_ms, max_rel_diff=diff,
                         error=error, packed_train_ms=train_ms if packed_ms == "same" else packed_ms)


def test_only_backends_every_selected_gpu_can_run_are_candidates():
    assert candidates(INSTALLED, [H100], "bf16") == ["sdpa", "flash_attention_2", "flash_attention_3",
                                                     "flash_attention_4"]
    # a mixed selection is as capable as its weakest GPU: no Hopper-only kernels with an A100 in it
    assert candidates(INSTALLED, [H100, A100], "bf16") == ["sdpa", "flash_attention_2"]
    assert candidates(INSTALLED, [T4], "fp16") == ["sdpa"]
    assert candidates(INSTALLED, [H100], "fp32") == ["sdpa"]  # flash kernels need fp16/bf16
    assert candidates(INSTALLED, [], "fp32") == ["sdpa"]
    assert usable("flex_attention", INSTALLED, [T4], "fp16") is None  # still there when asked for by name


def test_auto_picks_the_fastest_correct_backend_for_each_purpose():
    timings = [timing("sdpa", 2.0, 6.0), timing("flash_attention_2", 1.5, 4.0), timing("flash_attention_4", 1.0, 5.0),
               timing("flash_attention_3", 0.5, 3.0, diff=0.5)]  # fastest, but wrong: never chosen
    train, evaluation, why, problems = resolve_attention("auto", INSTALLED, [H100], "bf16", False, timings)
    assert (train, evaluation, problems) == ("flash_attention_2", "flash_attention_4", [])
    assert why["eval"].startswith("fastest measured for eval: flash_attention_4 1.00 ms")
    assert why["train"].startswith("fastest measured for packed train: flash_attention_2 4.00 ms")
    timings[2] = timing("flash_attention_4", None, None, error="RuntimeError: no kernel for this shape")
    assert resolve_attention("auto", INSTALLED, [H100], "bf16", False, timings)[1] == "flash_attention_2"


def test_training_is_judged_on_the_path_it_runs_and_a_switch_from_sdpa_needs_a_clear_win():
    # as measured on an H200: FA4 2% ahead of sdpa on a padded forward+backward, but packed training runs varlen
    # kernels, where it was behind (train-bench-1xGPU-20261201-142917: 0.66x the tokens/s of torch varlen)
    timings = [timing("sdpa", 2.37, 7.21, packed_ms=3.0), timing("flash_attention_4", 2.46, 7.05, packed_ms=4.5)]
    train, evaluation, why, _ = resolve_attention("auto", INSTALLED, [H100], "bf16", False, timings)
    assert (train, evaluation) == ("sdpa", "sdpa")
    assert why["train"] == "fastest measured for packed train: sdpa 3.00 ms, flash_attention_4 4.50 ms"
    # padded training (train.packing=false) compares the padded timings: FA4's 2% is within the switch margin
    train, _, why, _ = resolve_attention("auto", INSTALLED, [H100], "bf16", False, timings, packed=False)
    assert train == "sdpa"
    assert why["train"].endswith("flash_attention_4 is within 5% of sdpa, so sdpa")
    # a clear win (> 5%) switches, for each path on its own timings
    timings = [timing("sdpa", 2.0, 8.0, packed_ms=3.0), timing("flash_attention_4", 1.8, 7.0, packed_ms=3.1)]
    assert resolve_attention("auto", INSTALLED, [H100], "bf16", False, timings)[:2] == ("sdpa", "flash_attention_4")
    assert resolve_attention("auto", INSTALLED, [H100], "bf16", False, timings, packed=False)[0] == "flash_attention_4"
    # a backend without a packed timing (its varlen kernel failed) is never chosen for packed training
    timings = [timing("sdpa", 2.0, 8.0, packed_ms=3.0), timing("flash_attention_4", 1.0, 4.0, packed_ms=None)]
    assert resolve_attention("auto", INSTALLED, [H100], "bf16", False, timings)[0] == "sdpa"


def test_train_packing_decides_which_training_timing_the_plan_uses():
    host = [H100]
    timings = [timing("sdpa", 2.0, 8.0, packed_ms=3.0), timing("flash_attention_4", 2.0, 6.0, packed_ms=3.5)]
    packed = resolve_plan(load_config(None, ["hardware.gpus=0"]), report(host, fa4=True), selection_for("0", host),
                          timings)
    padded = resolve_plan(load_config(None, ["hardware.gpus=0", "train.packing=false"]), report(host, fa4=True),
                          selection_for("0", host), timings)
    assert (packed.train_attn, padded.train_attn) == ("sdpa", "flash_attention_4")



def test_compiled_packed_training_stays_on_the_kernel_the_compiler_traces():
    # as measured on the H200: the eager probe put FA4's packed forward+backward 8% ahead of sdpa's, yet compiled
    # training on FA4 ran at 0.66x the tokens/s of torch varlen (train-bench-1xGPU-20261201-142917), and the GPU
    # proof's flow, which auto had put on FA4, at 5,267 tokens/s steady (gpu-proof-1xGPU-20261201-174042)
    host = [H100]
    timings = [timing("sdpa", 2.74, 7.2, packed_ms=6.07), timing("flash_attention_4", 2.47, 7.0, packed_ms=5.57)]
    compiled = resolve_plan(load_config(None, ["hardware.gpus=0"]), report(host, fa4=True), selection_for("0", host),
                            timings)  # train.compile=auto compiles on a GPU under DDP
    assert (compiled.train_attn, compiled.eval_attn) == ("sdpa", "flash_attention_4")
    assert compiled.attention_choice["train"].startswith(
        "fastest measured for packed train: sdpa 6.07 ms; not flash_attention_4: compiled decoder layers call them "
        "untraced")
    # eager layers: the probe times what training runs, and its packed timing decides
    eager = resolve_plan(load_config(None, ["hardware.gpus=0", "train.compile=false"]), report(host, fa4=True),
                         selection_for("0", host), timings)
    assert eager.train_attn == "flash_attention_4"
    assert eager.attention_choice["train"] == ("fastest measured for packed train: flash_attention_4 5.57 ms, "
                                               "sdpa 6.07 ms")
    # an explicit backend is the user's call, compiled or not
    chosen = resolve_plan(load_config(None, ["hardware.gpus=0", "hardware.attn_implementation=flash_attention_4"]),
                          report(host, fa4=True), selection_for("0", host), timings)
    assert chosen.train_attn == "flash_attention_4"

@pytest.mark.train
def test_the_probe_times_padded_and_packed_training_and_checks_packed_rows_against_sdpa_on_the_cpu():
    from finetune_flows.models.backends import measure_on_device, packed_layouts

    for cu in packed_layouts(3, budget=2048):
        assert cu[0] == 0 and cu[-1] == 2048 and all(b > a for a, b in zip(cu, cu[1:]))
        assert max(b - a for a, b in zip(cu, cu[1:])) <= 1024
    assert len({tuple(cu) for cu in packed_layouts(3)}) == 3  # every timed step is a new shape
    (row,) = measure_on_device("cpu", ["sdpa"], {"heads": 4, "kv_heads": 2, "head_dim": 16}, "float32",
                               batch=4, length=64, layouts=3)
    assert row.error is None, row.error
    assert row.gpu == "cpu" and row.eval_ms > 0 and row.train_ms > 0 and row.packed_train_ms > 0
    assert row.correct and row.max_rel_diff < 1e-5  # one packed row of many examples = each example run alone


def test_a_mixed_host_is_judged_by_the_selected_gpus_not_its_best():
    host = [H100, A100]
    timings = [timing("sdpa", 2.0, 6.0, "NVIDIA A100 (sm_80)"), timing("flash_attention_2", 1.0, 3.0,
                                                                        "NVIDIA A100 (sm_80)")]
    cfg = load_config(None, ["hardware.gpus=1"])  # only the A100
    plan = resolve_plan(cfg, report(host, fa4=True, fa2=True), selection_for("1", host), timings)
    assert plan.eval_attn == "flash_attention_2"  # FA4 is installed and the host has a Hopper, but not selected
    with pytest.raises(EnvironmentMismatch, match=r"GPU 1 \(NVIDIA A100, compute capability 8.0\) cannot run it"):
        resolve_plan(load_config(None, ["hardware.gpus=0,1", "hardware.attn_implementation=flash_attention_4"]),
                     report(host, fa4=True), selection_for("0,1", host))
    only_h100 = resolve_plan(load_config(None, ["hardware.gpus=0", "hardware.attn_implementation=flash_attention_4"]),
                             report(host, fa4=True), selection_for("0", host))
    assert only_h100.eval_attn == "flash_attention_4"


def test_with_two_gpu_models_the_worst_case_decides():
    timings = [timing("sdpa", 2.0, 6.0), timing("flash_attention_2", 1.0, 3.0),
               timing("sdpa", 3.0, 9.0, "NVIDIA A100 (sm_80)"), timing("flash_attention_2", 4.0, 12.0,
                                                                      "NVIDIA A100 (sm_80)")]
    train, evaluation, _, _ = resolve_attention("auto", INSTALLED, [H100, A100], "bf16", False, timings)
    assert train == evaluation == "sdpa"  # FA2 wins on the H100 but loses on the A100, which every step waits for


def test_the_cpu_and_unmeasured_hosts_get_sdpa():
    assert resolve_attention("auto", INSTALLED, [], "fp32", False, None)[:2] == ("sdpa", "sdpa")
    _, _, why, _ = resolve_attention("auto", INSTALLED, [H100], "bf16", False, None)
    assert "not measured" in why["eval"]


def test_backends_and_engines_the_machine_cannot_run_are_refused_before_anything_loads():
    cpu = report([]).model_copy(update={"attention": {**report([]).attention, "flex_attention": "needs a CUDA GPU"}})
    with pytest.raises(EnvironmentMismatch, match="flex_attention cannot run here: needs a CUDA GPU"):
        resolve_plan(load_config(None, ["hardware.gpus=cpu", "hardware.attn_implementation=flex_attention"]),
                     cpu, selection_for("cpu", []))
    with pytest.raises(EnvironmentMismatch, match="eval.engine=continuous cannot use attention backend flex"):
        cfg = load_config(None, ["hardware.gpus=0", "hardware.attn_implementation=flex_attention",
                                 "eval.engine=continuous"])
        env = report([H100]).model_copy(update={"attention": INSTALLED})
        resolve_plan(cfg, env, selection_for("0", [H100]))
    with pytest.raises(EnvironmentMismatch, match="Hub is unreachable and LOCAL_KERNELS has no copy"):
        cfg = load_config(None, ["hardware.gpus=0", "hardware.attn_implementation=acme/flash-attn"])
        env = report([H100]).model_copy(update={"attention": {**INSTALLED, "hub_kernels": "available"}})
        resolve_plan(cfg, env, selection_for("0", [H100]))


def test_eval_attn_implementation_decides_the_evaluation_backend_alone():
    timings = [timing("sdpa", 2.0, 6.0), timing("flash_attention_4", 1.0, 4.0)]
    env = report([H100]).model_copy(update={"attention": INSTALLED})
    cfg = load_config(None, ["hardware.gpus=0", "eval.attn_implementation=sdpa", "train.compile=false"])
    plan = resolve_plan(cfg, env, selection_for("0", [H100]), timings)  # eager layers: the probe decides training
    assert (plan.train_attn, plan.eval_attn) == ("flash_attention_4", "sdpa")
    assert plan.attention_choice["eval"] == "configured" and plan.attention_choice["train"].startswith("fastest")
    cfg = load_config(None, ["hardware.gpus=0", "hardware.attn_implementation=sdpa", "eval.attn_implementation=auto"])
    assert resolve_plan(cfg, env, selection_for("0", [H100]), timings).eval_attn == "flash_attention_4"
    with pytest.raises(EnvironmentMismatch, match="eval.attn_implementation=flex_attention cannot run here"):
        cpu = report([]).model_copy(update={"attention": {**report([]).attention,
                                                          "flex_attention": "needs a CUDA GPU"}})
        resolve_plan(load_config(None, ["hardware.gpus=cpu", "eval.attn_implementation=flex_attention"]), cpu,
                     selection_for("cpu", []))
    with pytest.raises(ConfigError, match="eval.attn_implementation"):
        load_config(None, ["eval.attn_implementation=flash"])


def test_probe_results_are_store_entries_per_gpu_model_and_versions(tmp_path, monkeypatch):
    cfg = load_config(None, ["model.source=generated:qwen3-0.6b", f"run.cache_dir={tmp_path}", "hardware.gpus=0"])
    sel = selection_for("0", [H100])
    versions = {"torch": "2.11", "flash-attn-4": "4.0.0b36"}
    shape = {"heads": 16, "kv_heads": 8, "head_dim": 128}
    cached = Entry(tmp_path, "attention-probes", probe_key('NVIDIA H100', (9, 0), versions, shape, 'bfloat16'))
    probe = AttentionProbe(timings=[timing("sdpa", 2.0, 6.0), timing("flash_attention_4", 1.0, 5.0)])
    assert reuse_or_record([cached], AttentionProbe, lambda missing: [probe]) == [(probe, False)]
    assert json.loads(cached.manifest_path.read_text())["kind"] == "attention-probes"  # a store entry
    got = measured_timings(cfg, INSTALLED, versions, sel, "bf16", "bfloat16", tmp_path / "work")
    assert [t.backend for t in got] == ["sdpa", "flash_attention_4"]  # read back, no worker launched
    assert not (tmp_path / "work").exists()
    # a torn manifest is no probe: measured again (the GPU worker stands in for one, as no GPU is here)
    cached.manifest_path.write_text('{"format": 1, "files": {}, "res')
    asked = []
    monkeypatch.setattr("finetune_flows.models.backends.run_worker", lambda step, cmd, env, workdir: asked.append(
        json.loads((workdir / "attention-probe.job.json").read_text())["devices"]) or {cached.key: [
            timing("sdpa", 3.0, 7.0).model_dump()]})
    got = measured_timings(cfg, INSTALLED, versions, sel, "bf16", "bfloat16", tmp_path / "work")
    assert asked == [{cached.key: 0}] and [(t.backend, t.eval_ms) for t in got] == [("sdpa", 3.0)]
    assert cached.load(AttentionProbe).timings == got  # the new measurement, verified
    assert measured_timings(cfg, INSTALLED, versions, selection_for("cpu", []), "fp32", "float32",
                            tmp_path / "work") is None


def test_eval_dtype_auto_is_bf16_only_on_bf16_cpus_for_wide_models():
    from finetune_flows.runtime.environment import auto_eval_dtype

    wide, narrow = load_config(None, ["model.source=generated:qwen3-0.6b"]), load_config(None, [])
    tiny = load_config(None, ["model.source=generated:tiny-llama"])
    assert auto_eval_dtype(wide, on_gpu=False, cpu_bf16=True, compute="float32") == "bfloat16"
    assert auto_eval_dtype(tiny, on_gpu=False, cpu_bf16=True, compute="float32") == "float32"
    assert auto_eval_dtype(wide, on_gpu=False, cpu_bf16=False, compute="float32") == "float32"
    assert auto_eval_dtype(narrow, on_gpu=True, cpu_bf16=True, compute="bfloat16") == "bfloat16"
    plan = resolve_plan(load_config(None, ["hardware.gpus=cpu", "model.source=generated:qwen3-0.6b"]),
                        report([]).model_copy(update={"cpu_bf16": True}), selection_for("cpu", []))
    assert (plan.compute_dtype, plan.eval_dtype) == ("float32", "bfloat16")
    with pytest.raises(EnvironmentMismatch, match="eval.dtype=float16 needs a GPU"):
        resolve_plan(load_config(None, ["hardware.gpus=cpu", "eval.dtype=float16"]), report([]),
                     selection_for("cpu", []))
