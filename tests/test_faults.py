"""The fault suite, inside the training ranks and on the disk: each fault injected for real into the real pipeline
(tiny generated model, CPU, real Prefect, real torchrun) and the outcome checked. docs/faults.md's fault table lists
the whole suite (also tests/test_faults_signals.py and tests/test_faults_stack.py).

Faults inside the ranks are injected through FINETUNE_FLOWS_FAULTS (finetune_flows/runtime/lifecycle.py: a real
torch.OutOfMemoryError, a real SIGKILL); the full disk is a size-limited tmpfs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from fault_support import overrides
from flows.finetune import finetune
from finetune_flows.config.schema import load_config
from finetune_flows.errors import DiskFull
from finetune_flows.runtime.gpus import read_inventory
from finetune_flows.runtime.lifecycle import FAULTS_ENV
from finetune_flows.training.checkpoints import checkpoint_is_complete

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(shared_cache):
    return shared_cache / "faults"


# ---------------------------------------------------------------- inside the ranks


@pytest.mark.parametrize("seed,ranks", [(1, 1), (5, 2)])
def test_rank_sigkilled_at_a_random_step_resumes_to_the_same_final_step(prefect_server, cache, tmp_path, monkeypatch,
                                                                       seed, ranks):
    rng = random.Random(seed)
    step, victim = rng.randint(2, 7), rng.randrange(ranks)
    marker = tmp_path / "killed"
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"sigkill_at_step": step, "sigkill_rank": victim, "once": str(marker)}))
    # save_total_limit=2: the checkpoint the retry resumes from is rotated out as training goes on (saves every 2 steps)
    result = finetune(load_config(None, overrides(cache, tmp_path / "runs", **{
        "train.seed": 100 + seed, "train.retries": 1, "hardware.cpu_processes": ranks, "train.save_total_limit": 2})))
    assert marker.exists(), "the rank was never killed"
    train = result.train
    checkpoint = 2 * ((step - 1) // 2) or None  # the last one saved before the step the rank died in
    assert train.resumed_from_step == checkpoint
    assert train.steps == 8 and train.rank_steps == [8] * ranks
    assert [a["outcome"] for a in train.attempts] == ["crashed", "completed"]
    assert train.attempts[0]["error"] == "killed by SIGKILL"
    assert train.loss_curve[-1][0] == 8
    log = (Path(train.output_dir) / "train.log").read_text()
    assert f"resuming from checkpoint-{checkpoint}" in log and f"trained 8 steps on {ranks} cpu rank(s)" in log
    assert train.world_size == ranks and train.backend == "gloo"
    print(f"FAULT SIGKILL seed {seed}: rank {victim} of {ranks} killed before step {step}, resumed from step "
          f"{checkpoint}, finished {train.steps} steps")


def test_out_of_memory_halves_the_micro_batch_and_finishes(prefect_server, cache, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"oom_at_step": 3, "oom_below_split": 2}))
    result = finetune(load_config(None, overrides(cache, tmp_path / "runs", **{"train.seed": 201, "train.retries": 0})))
    train = result.train
    assert train.steps == 8 and train.micro_batch_split == 2
    assert [a["outcome"] for a in train.attempts] == ["out of memory", "completed"]
    assert [(a["split"], a["new_split"]) for a in train.oom_adaptations] == [(1, 2)]
    assert "CUDA out of memory (injected before step 3" in train.oom_adaptations[0]["message"]
    assert train.resumed_from_step == 2  # the attempt that ran out of memory had saved checkpoint-2
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["train"]["oom_adaptations"] and summary["train"]["micro_batch_split"] == 2
    print(f"FAULT OOM at step 3: split 1 -> 2, resumed from step {train.resumed_from_step}, {train.steps} steps")


# ---------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 1.2 MB tmpfs: room for two checkpoints of the tiny model (~470 KB each), not three."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)]
                                           ).returncode != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (CI runs as root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_full_disk_while_saving_a_checkpoint_is_one_clear_error_and_loses_nothing(prefect_server, cache, tmp_path,
                                                                                  small_disk):
    own = tmp_path / "cache"  # the shared models, dataset and 4-bit base, but adapters on the small disk
    own.mkdir()
    for name in ("models", "tokenizers", "datasets", "quantized"):
        (cache / name).mkdir(parents=True, exist_ok=True)
        (own / name).symlink_to(cache / name)
    (own / "adapters").symlink_to(small_disk)
    earlier = small_disk / "written-before.bin"
    earlier.write_bytes(os.urandom(2**16))
    before = earlier.read_bytes()
    args = overrides(own, tmp_path / "runs", **{"train.seed": 401, "train.retries": 2})

    with pytest.raises(DiskFull) as info:
        finetune(load_config(None, args))
    message = str(info.value)
    assert "no space left on the device" in message and "\n" not in message, message
    print(f"FAULT full disk: {message}")
    (out,) = [p for p in small_disk.iterdir() if p.is_dir()]
    saved = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("checkpoint-*")
                   if checkpoint_is_complete(p))
    assert saved[:2] == [2, 4], saved  # what was saved before the disk filled up is whole
    assert earlier.read_bytes() == before
    attempts = json.loads((out / "attempts.json").read_text())
    assert len(attempts) == 1, "a full disk was retried"

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    result = finetune(load_config(None, args))
    assert result.train.resumed_from_step == saved[-1] and result.train.steps == 8


# ---------------------------------------------------------------- GPU tier: a real CUDA out-of-memory


@pytest.mark.gpu
@pytest.mark.skipif(not read_inventory(), reason="needs an NVIDIA GPU (NVML finds none)")
def test_absurd_micro_batch_on_a_gpu_runs_out_of_memory_adapts_and_finishes(prefect_server, gpu_cache, tmp_path):
    """64k tokens in one packed micro-batch of a Qwen3-0.6B-shaped model, without checkpointing or Liger: its
    logits (150k vocabulary) and their gradients do not fit an H200, so CUDA runs out of memory until the
    micro-batch is cut. Seen on an H200: 64k-token pieces ran out of memory (37 GiB asked with 134 GiB in use),
    32k-token pieces trained; starting at 64k makes that one adaptation, not two (each costs a worker start)."""
    result = finetune(load_config(None, [
        "model.source=generated:qwen3-0.6b", "hardware.gpus=auto:1", "data.builtin_examples=3400",
        "data.max_length=128", "train.per_device_batch_size=1700", "train.micro_batch_tokens=65536",
        "train.gradient_checkpointing=false", "train.liger_kernel=false", "train.max_steps=2", "train.save_steps=1",
        "train.logging_steps=1", "train.retries=0", "eval.max_samples=4", "eval.batch_size=4",
        f"run.cache_dir={gpu_cache}", f"run.output_dir={tmp_path / 'runs'}"]))
    train = result.train
    assert train.steps == 2 and train.micro_batch_split >= 2 and train.oom_adaptations
    assert all("out of memory" in a["message"].lower() for a in train.oom_adaptations)
    print(f"FAULT GPU OOM: splits {[(a['split'], a['new_split']) for a in train.oom_adaptations]}, finished with "
          f"split {train.micro_batch_split}, peak reserved {train.peak_memory_mb} MiB, NVML process "
          f"{train.peak_process_memory_mb} MiB")
