"""`make bench-eval` end to end on the CPU with a tiny model: every engine, one report with the promised keys."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def bench(tmp_path, variants: str, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "benchmarks/eval_speed.py", "--smoke", "--threads", "1",
                           "--variants", variants, *extra, "--work", str(tmp_path / "work"),
                           "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_evaluation_benchmark_smoke_run_writes_the_report(tmp_path):
    bench(tmp_path, "generate,static,continuous,generate-static")
    [folder] = (tmp_path / "out").glob("eval-bench-0xGPU-*")
    report = json.loads((folder / "report.json").read_text())
    for key in ("gpu", "baseline_seconds", "seconds", "speedup", "greedy_agreement", "rows", "versions", "shape"):
        assert key in report, key
    assert [r["variant"] for r in report["rows"]] == ["generate", "static", "continuous", "generate-static"]
    assert report["auto"] == {**report["auto"], "engine": "static", "attention": "sdpa", "variant": "static"}
    for row in report["rows"]:
        assert "error" not in row, row
        for side in ("base", "adapter"):
            assert row[side]["generated_tokens"] > 0 and row[side]["seconds"] > 0
            assert 0 < row[side]["first_result_seconds"] <= row[side]["seconds"]
            assert row[side]["warmup_prompts"] == 40  # warmed up on every timed prompt: steady passes only
    # the copy and the 4-bit model differ only by kernel rounding: nearly every greedy answer is the same
    assert report["greedy_agreement"] >= 0.9 and report["rows"][2]["agreement"] >= 0.9
    library = report["rows"][3]  # transformers' generate() with its static cache, on the same copy as `static`
    assert library["agreement"] >= 0.9 and library["base"]["details"]["cache_implementation"] == "static"
    assert library["base"]["details"]["compiled_decode"] is False  # generate compiles on CUDA only
    assert library["base"]["details"]["max_cache_len"] == report["shape"]["prompt_tokens_min_mean_max"][2] + 8
    assert report["shape"]["prompts"] == 40 and "| static | sdpa |" in (folder / "report.md").read_text()
    # a rerun on the same --work reuses the dataset, the 4-bit base and the adapter (the steps return `Cached`
    # states: the benchmark once failed on exactly that, "'State' object has no attribute 'fingerprint'")
    rerun = bench(tmp_path, "static", "--repeats", "3")
    assert "reused" in rerun.stdout + rerun.stderr and len(list((tmp_path / "out").glob("eval-bench-0xGPU-*"))) == 2
    # repeated runs: the median is reported beside every run, and auto's choice is judged against their spread
    [again] = sorted((tmp_path / "out").glob("eval-bench-0xGPU-*"))[1:]
    report = json.loads((again / "report.json").read_text())
    static = report["rows"][1]
    assert len(static["base"]["runs_seconds"]) == 3
    assert static["base"]["seconds"] == sorted(static["base"]["runs_seconds"])[1]
    assert report["auto"]["fastest_variant"] == "static" and report["auto"]["auto_is_fastest_or_tied"]


def test_a_variant_within_the_spread_of_the_fastest_runs_is_a_tie_and_one_outside_is_not():
    from conftest import load_benchmark

    bench_module = load_benchmark("eval_speed")
    rows = [{"variant": "generate", "seconds": 60.0},
            {"variant": "static", "seconds": 4.10, "runs_seconds": [4.05, 4.10, 4.20]},  # sdpa
            {"variant": "static[flash_attention_4]", "seconds": 4.05, "runs_seconds": [4.00, 4.05, 4.15]},
            {"variant": "continuous", "seconds": 9.0, "runs_seconds": [8.9, 9.0, 9.2]},
            {"variant": "static-eager", "error": "boom"}]
    fastest, ties = bench_module.fastest_and_ties(rows)
    assert fastest == "static[flash_attention_4]" and ties == ["static", "static[flash_attention_4]"]
