"""Bookkeeping of training attempts (finetune_flows/training/attempts.py): the split after out-of-memory, failures that
repeat, and figures over all attempts. The fault suite runs the same code against real workers; these pin the
arithmetic."""

from __future__ import annotations

import json

import pytest

from finetune_flows.training.attempts import (
    AttemptLog, adapt_after_oom, current_split, error_line, kept_layout, run_attempts, split_limit, whole_run,
    worker_error,
)
from finetune_flows.data.packing import build_schedule
from finetune_flows.training.planner import TrainingPlan
from finetune_flows.errors import RepeatedFailure, WorkerFailed, WorkerOOM, is_retryable
from finetune_flows.runtime.launcher import python_module, run_worker, write_job


def test_split_limit_is_one_row_per_piece_or_64():
    assert split_limit(True, micro_batch_tokens=4096, micro_batch_rows=0, longest_row=512) == 8
    assert split_limit(True, micro_batch_tokens=10**6, micro_batch_rows=0, longest_row=16) == 64
    assert split_limit(False, micro_batch_tokens=0, micro_batch_rows=3, longest_row=512) == 3


def test_out_of_memory_doubles_the_split_until_it_cannot(tmp_path):
    oom = WorkerOOM("train", 1, "", split=1, message="CUDA out of memory. Tried to allocate 2.00 GiB")
    assert current_split(tmp_path) == 1
    assert adapt_after_oom(tmp_path, oom, limit=3) == 2
    assert adapt_after_oom(tmp_path, oom, limit=3) == 3  # never past the limit
    with pytest.raises(RepeatedFailure, match="cut into 3 pieces"):
        adapt_after_oom(tmp_path, oom, limit=3)
    adapt = json.loads((tmp_path / "adapt.json").read_text())
    assert adapt["split"] == 3 and [(h["split"], h["new_split"]) for h in adapt["history"]] == [(1, 2), (2, 3)]


def _packed(tokens: int, accumulation: int) -> TrainingPlan:
    return TrainingPlan(packing=True, micro_batch_tokens=tokens, micro_batch_rows=0,
                        gradient_accumulation_steps=accumulation, gradient_checkpointing=False,
                        tokens_per_step=9330.0, predicted_peak_gib=1.0, budget_gib=None, reasons=[])


def _steps(schedule) -> list[list[int]]:
    per = schedule.accumulation
    batches = schedule.micro_batches
    return [sorted(i for mb in batches[s * per:(s + 1) * per] for i in mb) for s in range(schedule.steps)]


def test_a_resumed_run_trains_the_rows_its_checkpoints_were_trained_with_whatever_memory_plans_now(tmp_path):
    """With packing the micro-batch size decided which rows share a step: 9,330 tokens x 1 (a whole GPU) and 3,110 x 3
    (a 4 GiB budget) train different rows at every step, so a resume on a GPU with less free memory went on with
    another schedule, skipping and repeating rows. The resumed run keeps the checkpoints' layout, cut into pieces."""
    import random

    rng = random.Random(0)
    lengths = [rng.randint(32, 1024) for _ in range(2000)]
    whole, tight = _packed(9330, 1), _packed(3110, 3)

    def schedule(plan: TrainingPlan, split: int = 1):
        return build_schedule(lengths, plan.micro_batch_tokens, plan.gradient_accumulation_steps, 1, 42, 30,
                              split=split)

    assert kept_layout(tmp_path, whole, resuming=False) == (whole, 1)  # the first attempt records its layout
    assert sum(a != b for a, b in zip(_steps(schedule(whole)), _steps(schedule(tight)))) > 25  # the problem
    resumed, split = kept_layout(tmp_path, tight, resuming=True)  # checkpoints, and less memory now
    assert (resumed.micro_batch_tokens, resumed.gradient_accumulation_steps, split) == (9330, 1, 4)
    assert "resumed with the layout its checkpoints were trained with, 9330 tokens x 1" in resumed.reasons[-1]
    pieces = schedule(resumed, split)
    assert _steps(pieces) == _steps(schedule(whole))
    assert max(sum(lengths[i] for i in mb) for mb in pieces.micro_batches) <= 3110  # within this plan's micro-batch
    more, split = kept_layout(tmp_path, _packed(18660, 1), resuming=True)  # more memory: the same layout, whole
    assert (more.micro_batch_tokens, split) == (9330, 1)
    assert kept_layout(tmp_path, tight, resuming=False) == (tight, 1)  # a fresh start records the new layout
    assert json.loads((tmp_path / "layout.json").read_text()) == {"micro_batch_tokens": 3110,
                                                                   "gradient_accumulation_steps": 3}


def test_error_lines_compare_across_attempts():
    torchrun = ["Traceback (most recent call last):", "ValueError: bad value at 0x7f3a2b", "",
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
                "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"]
    assert error_line(torchrun) == "ValueError: bad value at #"
    assert error_line(["  traceback : Signal 9 (SIGKILL) received by PID 12345"]) == "killed by SIGKILL"
    # torchrun's summary: the root cause's signal, not that of a rank it stopped (listed first, under Failures)
    summary = ["[rank0]: RuntimeError: Connection closed by peer", "Failures:", "[1]:", "  exitcode  : -15 (pid: 1)",
               "  traceback : Signal 15 (SIGTERM) received by PID 1", "Root Cause (first observed failure):", "[0]:"]
    assert error_line(summary + ["  exitcode  : -9 (pid: 2)", "  traceback : Signal 9 (SIGKILL) received by PID 2"]
                      ) == "killed by SIGKILL"
    assert error_line(summary[1:] + ["  exitcode  : 1 (pid: 2)", "  traceback : To enable traceback see: x"]
                      ) == "a rank exited with code 1"
    # a rank started without torchrun (one CPU rank) ends with the signal itself: its exit status names it
    assert worker_error(WorkerFailed("train", -9, "step 3/8 loss 6.9")) == "killed by SIGKILL"
    assert worker_error(WorkerFailed("train", 1, "\n".join(torchrun))) == "ValueError: bad value at #"


def test_the_same_crash_from_the_same_checkpoint_repeats(tmp_path):
    log = AttemptLog(tmp_path)
    for _ in range(2):
        log.begin(split=1, resumed_from=4)
        log.end("crashed", "ValueError: bad value")
    assert log.repeats()
    log.begin(split=1, resumed_from=6)  # progress since: not the same
    log.end("crashed", "ValueError: bad value")
    assert not log.repeats()


def test_whole_run_adds_the_measured_part_of_earlier_attempts(tmp_path):
    log = AttemptLog(tmp_path)
    log.begin(split=1, resumed_from=None)
    for rank, tokens in ((0, 300), (1, 280)):
        log.observe({"kind": "progress", "rank": rank, "step": 5, "tokens": tokens, "seconds": 10.0,
                     "process_mb": 900.0})
    log.end("crashed", "killed by SIGKILL")
    log.begin(split=1, resumed_from=4)  # the attempt that finishes: its own result has its figures
    final = {"train_tokens": 1000, "train_seconds": 20.0, "tokens_per_second": 50.0}
    run = whole_run(tmp_path, final)
    assert (run["train_tokens"], run["train_seconds"], run["tokens_per_second"]) == (1580, 30.0, 52.7)
    assert run["last_attempt_tokens_per_second"] == 50.0 and len(run["attempts"]) == 2
    assert run["attempts"][0]["peak_process_mb"] == 900.0


def test_out_of_memory_that_no_split_avoids_stops_with_one_message(tmp_path):
    """Real workers (tests/fault_worker.py) that run out of memory whatever the split: the attempts stop once a piece
    holds a single row, with one message, and that error is not retried. (The fault suite runs the adapting case
    with the real training worker.)"""
    launched = []

    def launch(split, observe):
        launched.append(split)
        job = write_job(tmp_path, "train", do="oom", micro_batch_split=split)
        run_worker("train", python_module("tests.fault_worker", job), {}, tmp_path, on_event=observe)

    with pytest.raises(RepeatedFailure) as info:
        run_attempts(tmp_path, limit=4, resume_point=lambda: None, launch=launch)
    assert launched == [1, 2, 4]
    assert str(info.value).startswith("training ran out of memory even with each micro-batch cut into 4 pieces")
    assert not is_retryable(info.value)
    outcomes = [a["outcome"] for a in json.loads((tmp_path / "attempts.json").read_text())]
    assert outcomes == ["out of memory"] * 3
