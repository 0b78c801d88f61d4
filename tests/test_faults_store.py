"""Faults on the store, injected for real on the tiny pipeline: a truncated completion marker, a 4-bit checkpoint
that lost its weights, four identical runs at once, and a pickled payload planted in Prefect's result storage."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, child_env, tiny_config, tiny_overrides
from flows.finetune import finetune

pytestmark = pytest.mark.slow

ALL_STEPS = ["prepare-dataset", "quantize-base-model", "train-adapter", "evaluate-adapter"]


@pytest.fixture(scope="module")
def first_run(prefect_server, tmp_path_factory):
    cache, runs = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("runs")
    return finetune(tiny_config(cache, runs)), cache, runs


def entry_of(path: Path) -> Path:
    """The store entry (the directory holding manifest.json) a result path lies in."""
    return next(p for p in [path, *path.parents] if (p / "manifest.json").is_file())


def test_truncated_completion_marker_is_recomputed(first_run):
    result, cache, runs = first_run
    metrics = Path(result.train.output_dir) / "train_metrics.json"  # a kill or a full disk mid-write
    metrics.write_text(metrics.read_text()[:50])
    eval_manifest = entry_of(Path(result.eval.path)) / "manifest.json"
    eval_manifest.write_text(eval_manifest.read_text()[:30])

    again = finetune(tiny_config(cache, runs))
    assert again.cached_steps == ["prepare-dataset", "quantize-base-model"]
    assert again.train.steps == 6 and again.train.resumed_from_step == 6  # from its last complete checkpoint
    assert json.loads(metrics.read_text())["steps"] == 6 and json.loads(eval_manifest.read_text())["files"]
    assert again.eval.adapter.loss == pytest.approx(result.eval.adapter.loss, rel=1e-6)
    assert finetune(tiny_config(cache, runs)).cached_steps == ALL_STEPS  # whole again
    assert latest_task_run_states() == dict.fromkeys(ALL_STEPS, "Cached")  # what the Prefect UI shows


def latest_task_run_states() -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    names = {t.name.split("(")[0]: t.state.name for t in tasks}  # task run names are `<step>(<what>)`
    return {step: state for step, state in names.items() if step in ALL_STEPS}


def test_four_bit_checkpoint_missing_its_weights_is_not_complete(first_run):
    result, cache, runs = first_run
    quantized = Path(json.loads((Path(result.train.output_dir) / "train.job.json").read_text())["base"])
    (quantized / "model.safetensors").unlink()  # config.json is still there
    again = finetune(tiny_config(cache, runs))
    assert "quantize-base-model" not in again.cached_steps and (quantized / "model.safetensors").is_file()
    assert again.train.steps == 6


def test_a_pickled_payload_in_the_result_storage_is_never_executed(first_run, tmp_path):
    """Prefect's result store holds pickles; the pipeline neither writes nor reads it."""
    from prefect.results import ResultStore

    result, cache, runs = first_run
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    pickle.loads(pickle.dumps(Payload()))  # the payload is live: unpickling it runs the command
    assert marker.exists()
    marker.unlink()
    storage = Path(os.environ["PREFECT_LOCAL_STORAGE_PATH"])
    store = ResultStore()
    prefixes = {"datasets": "dataset-", "quantized": "quantized-", "adapters": "adapter-", "evals": "eval-"}
    for kind, prefix in prefixes.items():  # the result keys the pipeline's Prefect cache used to look up
        for entry in (cache / kind).iterdir():
            store.persist_result_record(store.create_result_record(Payload(), key=prefix + entry.name))
            (entry / "result.pickle").write_bytes(pickle.dumps(Payload()))
    planted = {p for p in storage.rglob("*") if p.is_file()}
    assert len(planted) >= 4

    again = finetune(tiny_config(cache, runs))
    assert again.cached_steps == ALL_STEPS
    fresh = finetune(tiny_config(cache, runs, **{"train.learning_rate": 2e-3}))  # new train + eval entries
    assert fresh.cached_steps == ["prepare-dataset", "quantize-base-model"]
    assert not marker.exists()
    assert {p for p in storage.rglob("*") if p.is_file()} == planted  # no run wrote a result either


def test_four_identical_runs_started_at_once_train_once_and_all_finish(prefect_server, tmp_path):
    """Four CLI processes on one server and one cache: one producer per entry, the others wait and reuse."""
    from prefect.settings import PREFECT_API_URL

    env = child_env(PREFECT_API_URL=PREFECT_API_URL.value())
    argv = [sys.executable, "flows/finetune.py"]
    for override in tiny_overrides(tmp_path / "cache", tmp_path / "runs", **{"hardware.gpus": "cpu"}):
        argv += ["--set", override]
    procs = [subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(4)]
    lines: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, out=out: out.extend(p.stdout), daemon=True)
               for p, out in zip(procs, lines)]
    for reader in readers:
        reader.start()
    # Four processes on two loaded cores start seconds apart, and the tiny training is quick: the first producer
    # could finish before another run asks for the adapter. Pausing the producer once its worker starts (it holds
    # the adapter's lock) makes the others meet the lock, however late they come.
    deadline = time.monotonic() + 900
    producer = None
    try:
        while producer is None and time.monotonic() < deadline and any(p.poll() is None for p in procs):
            producer = next((p for p, out in zip(procs, lines) if any("starting train worker" in ln for ln in out)),
                            None)
            time.sleep(0.2)
        assert producer is not None, "no run started its training worker"
        producer.send_signal(signal.SIGSTOP)
        waiting = lambda: sum(any("waiting for adapters/" in ln for ln in out) for out in lines)  # noqa: E731
        while waiting() < 3 and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.5)
    finally:
        if producer is not None:
            producer.send_signal(signal.SIGCONT)
    for proc in procs:
        proc.wait(timeout=1200)
    for reader in readers:
        reader.join(timeout=60)
    outputs = ["".join(out) for out in lines]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-4000:]
    text = "\n".join(outputs)
    for step in ("quantize", "train", "evaluate"):
        assert text.count(f"starting {step} worker") == 1, f"{step} ran {text.count(f'starting {step} worker')} times"
    assert sum("waiting for adapters/" in out for out in outputs) == 3, "the other runs did not wait for the lock"
    run_dirs = [Path(json.loads(out.strip().splitlines()[-1])["run_dir"]) for out in outputs]
    assert len(set(run_dirs)) == 4
    adapters = {(d / "adapter" / "adapter_model.safetensors").read_bytes() for d in run_dirs}
    assert len(adapters) == 1
    cached = [json.loads((d / "summary.json").read_text())["cached_steps"] for d in run_dirs]
    assert sorted("train-adapter" in c for c in cached) == [False, True, True, True], cached


@pytest.mark.parametrize("planted", ["optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"])
def test_a_pickle_planted_in_a_checkpoint_is_never_executed_on_resume(tmp_path, planted):
    """A resume (transformers' Trainer, as the training worker resumes) reads the adapter's safetensors and
    trainer_state.json, and optimizer.pt, scheduler.pt and rng_state.pth through torch.load(weights_only=True),
    which refuses anything but tensors and plain containers; training_args.bin is written, never read. A
    payload planted in any of them does not run: the resume stops on it, or never reads it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from tests.test_packing import random_rows, tiny_qwen3

    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    def trainer(steps: int) -> Trainer:
        torch.manual_seed(0)
        model = get_peft_model(tiny_qwen3(2).train(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                               task_type="CAUSAL_LM"))
        args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, max_steps=steps,
                                 use_cpu=True, report_to=[], save_strategy="steps", save_steps=2, disable_tqdm=True,
                                 remove_unused_columns=False)
        rows = random_rows([9, 12, 7, 10])
        collate = lambda batch: {k: torch.tensor([batch[0][k]]) for k in ("input_ids", "labels")}  # noqa: E731
        return Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)

    trainer(2).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / planted).is_file()
    torch.save(Payload(), checkpoint / planted)
    resumed = trainer(4)
    if planted == "training_args.bin":
        resumed.train(resume_from_checkpoint=str(checkpoint))
        assert resumed.state.global_step == 4
    else:
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            resumed.train(resume_from_checkpoint=str(checkpoint))
    assert not marker.exists()
    torch.load(checkpoint / planted, weights_only=False)  # the payload is live: fully unpickled, it runs
    assert marker.exists()
