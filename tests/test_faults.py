"""The fault suite: each fault injected for real into the real pipeline (tiny generated model, CPU, real Prefect,
real torchrun), and the outcome checked. The README's fault table lists them.

Faults inside the training ranks are injected through FINETUNE_FLOWS_FAULTS (tasks/lifecycle.py: a real
torch.OutOfMemoryError, a real SIGKILL); faults from outside (signals to the flow process, cancellation through the
API, a server restart, a full disk, concurrent starts) are done to real processes from here.
"""

from __future__ import annotations

import json
import random

import pytest

from conftest import tiny_overrides
from flows.finetune import finetune
from tasks.errors import RepeatedFailure
from tasks.lifecycle import FAULTS_ENV

pytestmark = pytest.mark.slow


def overrides(cache, runs, **extra):
    """Short runs that checkpoint every 2 steps and evaluate on 4 rows; each test its own seed (its own adapter)."""
    return tiny_overrides(cache, runs, **{"train.max_steps": 8, "train.save_steps": 2, "train.save_total_limit": 10,
                                          "train.logging_steps": 1, "eval.max_samples": 4, **extra})


@pytest.fixture(scope="module")
def cache(shared_cache):
    return shared_cache / "faults"


# ---------------------------------------------------------------- inside the ranks


@pytest.mark.parametrize("seed,ranks", [(1, 1), (2, 1), (3, 2)])
def test_rank_sigkilled_at_a_random_step_resumes_to_the_same_final_step(prefect_server, cache, tmp_path, monkeypatch,
                                                                       seed, ranks):
    rng = random.Random(seed)
    step, victim = rng.randint(2, 7), rng.randrange(ranks)
    marker = tmp_path / "killed"
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"sigkill_at_step": step, "sigkill_rank": victim, "once": str(marker)}))
    result = finetune(None, overrides(cache, tmp_path / "runs", **{
        "train.seed": 100 + seed, "train.retries": 1, "hardware.cpu_processes": ranks}))
    assert marker.exists(), "the rank was never killed"
    train = result.train
    checkpoint = 2 * ((step - 1) // 2) or None  # the last one saved before the step the rank died in
    assert train.resumed_from_step == checkpoint
    assert train.steps == 8 and train.rank_steps == [8] * ranks
    assert [a["outcome"] for a in train.attempts] == ["crashed", "completed"]
    assert train.attempts[0]["error"] == "killed by SIGKILL"
    assert train.loss_curve[-1][0] == 8


def test_out_of_memory_halves_the_micro_batch_and_finishes(prefect_server, cache, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"oom_at_step": 3, "oom_below_split": 2}))
    result = finetune(None, overrides(cache, tmp_path / "runs", **{"train.seed": 201, "train.retries": 0}))
    train = result.train
    assert train.steps == 8 and train.micro_batch_split == 2
    assert [a["outcome"] for a in train.attempts] == ["out of memory", "completed"]
    assert [(a["split"], a["new_split"]) for a in train.oom_adaptations] == [(1, 2)]
    assert "CUDA out of memory (injected before step 3" in train.oom_adaptations[0]["message"]
    assert train.resumed_from_step == 2  # the attempt that ran out of memory had saved checkpoint-2
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["train"]["oom_adaptations"] and summary["train"]["micro_batch_split"] == 2


def test_out_of_memory_that_no_split_avoids_stops_with_one_message(prefect_server, cache, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"oom_at_step": 1}))
    with pytest.raises(RepeatedFailure, match="ran out of memory even with each micro-batch cut into"):
        finetune(None, overrides(cache, tmp_path / "runs", **{"train.seed": 202, "train.retries": 3}))
