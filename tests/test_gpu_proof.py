"""benchmarks/gpu_proof.py on this CPU: which backends it compares, its GPU tier split over a lent machine's calls,
bad arguments before anything runs, and a stop by SIGTERM (a call's time limit) that keeps the report."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, child_env, load_benchmark
from finetune_flows.runtime.processes import tree
from test_gpus import gpu, report

H100 = gpu(0, 80000, name="NVIDIA H100", cc=(9, 0))


def test_gpu_proof_compares_two_different_backends_or_says_it_made_no_comparison():
    proof = load_benchmark("gpu_proof")
    only_sdpa = report([H100])  # flash-attn not installed
    with_fa4 = report([H100], fa4=True)
    assert proof.other_backend("flash_attention_4", with_fa4)[0] == "sdpa"
    assert proof.other_backend("sdpa", with_fa4)[0] == "flash_attention_4"
    other, why = proof.other_backend("sdpa", only_sdpa)
    assert other is None and "no other attention backend is installed and usable" in why


def test_gpu_proof_reuses_the_gpu_tier_an_earlier_call_left_and_refuses_when_there_is_none(tmp_path):
    proof = load_benchmark("gpu_proof")
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    with pytest.raises(SystemExit, match="no earlier GPU test results"):
        proof.gpu_tests("reuse", work, out)
    assert proof.gpu_tests("skip", work, out)["summary"] == "skipped"
    earlier = {"exit_code": 0, "seconds": 1.0, "results": ["PASSED tests/test_gpu.py::x"], "summary": "1 passed"}
    (work / "gpu-tests.json").write_text(json.dumps(earlier))
    (work / "gpu-tests-0.log").write_text("the log")
    assert proof.gpu_tests("reuse", work, out) == earlier
    assert "the log" in (out / "gpu-tests.log").read_text()  # the report directory gets the earlier call's log


def test_gpu_proof_splits_the_gpu_tier_over_calls_and_keeps_every_part(tmp_path):
    """A lent machine's call has a time limit shorter than the whole tier: `--test-paths` runs a part, and
    `--append-tests` adds the next part's results (here the real pytest run of two files, skipped without a GPU)."""
    proof = load_benchmark("gpu_proof")
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    first = proof.gpu_tests("only", work, out, ["tests/test_faults.py"])
    assert first["exit_code"] == 0 and len(first["parts"]) == 1 and first["results"]
    both = proof.gpu_tests("only", work, out, ["tests/test_sharding.py"], append=True)
    assert [p["paths"] for p in both["parts"]] == [["tests/test_faults.py"], ["tests/test_sharding.py"]]
    assert both["results"] == first["results"] + both["parts"][1]["results"]
    assert any("test_sharding.py" in line for line in both["results"])
    assert json.loads((work / "gpu-tests.json").read_text()) == both  # what `--tests reuse` will report
    log = (out / "gpu-tests.log").read_text()  # written as the tests run; every part's, in order
    assert log.index("test_faults.py") < log.index("test_sharding.py")
    assert (out / "gpu-tests-0.xml").is_file() and (out / "gpu-tests-1.xml").is_file()


def test_a_gpu_tier_part_cut_short_keeps_its_log_and_counts_as_not_finished(tmp_path):
    """A call's time limit can stop pytest mid-part (seen on an H200: the first part's log was then overwritten by
    the next call's). The part is recorded before it starts, so the next part is numbered after it."""
    proof = load_benchmark("gpu_proof")
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    cut = {"exit_code": None, "seconds": None, "paths": ["tests/test_gpu.py"], "results": [],
           "summary": "not finished (stopped before pytest ended)"}
    (work / "gpu-tests.json").write_text(json.dumps({"parts": [cut]}))
    (work / "gpu-tests-0.log").write_text("PASSED tests/test_gpu.py::test_environment_report_matches_nvidia_smi")
    result = proof.gpu_tests("only", work, out, ["tests/test_sharding.py"], append=True)
    assert [p["paths"] for p in result["parts"]] == [["tests/test_gpu.py"], ["tests/test_sharding.py"]]
    assert result["exit_code"] == 124 and result["summary"].startswith("not finished")
    log = (out / "gpu-tests.log").read_text()
    assert log.index("===== gpu-tests-0.log") < log.index("test_environment_report") < log.index(
        "===== gpu-tests-1.log") < log.index("test_sharding.py")


def test_gpu_proof_names_a_test_path_that_does_not_exist_before_doing_anything(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_proof.py", "--tests", "only", "--work", str(tmp_path),
                           "--test-paths", "tests/test_gpu.py,tests/test_nope.py"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--test-paths: no such test file" in proc.stderr and "test_nope.py" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing probed or written


@pytest.mark.slow
def test_a_signal_to_gpu_proof_stops_its_flow_run_and_keeps_the_report(prefect_server, tmp_path):
    """A lent GPU machine ends a call with SIGTERM: the proof stops the running flow's workers (nothing outlives
    it), says which run it stopped, and keeps the report of what finished (here on the CPU, as a dry run)."""
    from prefect.settings import PREFECT_API_URL

    log = tmp_path / "proof.log"
    argv = [sys.executable, "benchmarks/gpu_proof.py", "--tests", "skip", "--model", "generated:tiny-llama",
            "--demo-model", "", "--runs", "1gpu-auto-attn", "--work", str(tmp_path / "work"), "--out",
            str(tmp_path / "out")]
    proc = subprocess.Popen(argv, cwd=REPO, env=child_env(PREFECT_API_URL=PREFECT_API_URL.value()),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "starting train worker" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None and "starting train worker" in log.read_text(), log.read_text()[-3000:]
        time.sleep(2)
        members = tree(proc.pid)  # the proof and its training worker (torchrun and a rank where there are ranks)
        assert len(members) >= 2, members
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [m for m in members if m.is_running()], "a process of the proof outlived it"
    report = json.loads(next((tmp_path / "out").glob("gpu-proof-*/report.json")).read_text())
    assert report["stopped"] == {"run": "1gpu-auto-attn", "signal": "SIGTERM"} and report["flow_runs"] == []
    assert "STOPPED by SIGTERM during 1gpu-auto-attn" in next((tmp_path / "out").glob("gpu-proof-*/report.md")
                                                               ).read_text()
    assert "gpu-proof stopped by SIGTERM" in log.read_text()


def test_the_report_shows_whole_run_and_steady_tokens_per_second():
    """A short compiled run's whole-run rate hides its steady one (60 steps on an H200: 562 tokens/s whole run, the
    first step spent compiling): the flow-run table shows both. Rendered from a committed H200 report."""
    proof = load_benchmark("gpu_proof")
    report = json.loads((REPO / "benchmarks/results/gpu-proof-1xGPU-20261201-141724/report.json").read_text())
    assert "| 562.4 (-) |" in proof.markdown(report)  # made before the steady rate was recorded
    report["flow_runs"][0]["train"]["steady_tokens_per_second"] = 4055.0  # that run's steady rate (its log)
    assert "| 562.4 (4055.0) |" in proof.markdown(report)
