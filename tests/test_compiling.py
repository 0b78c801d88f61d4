"""train.compile=auto: the decoder layers start eager and are compiled once the measured steps show that the rest of the
run repays the compilation (finetune_flows/training/compiling.py). The decision, the record of what compiling took, and
the real thing: a Trainer on the CPU whose layers are compiled mid-run (Dynamo's own backend, so no kernels are
built)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from finetune_flows.store.entries import Entry
from finetune_flows.training import compiling
from finetune_flows.models.attention import use_packed_attention
from finetune_flows.training.distributed import gather
from finetune_flows.data.packing import PackedCollator
from finetune_flows.training.clock import StepClock, steady_state
from finetune_flows.training.worker import _callbacks
from tests.test_packing import random_rows, tiny_qwen3


def test_a_run_compiles_only_when_the_steps_left_repay_the_compilation():
    # the GPU proof's flow on the H200: 0.32 s eager steps; 54 steps left save ~5 s, far from a ~90 s compilation
    worth, why = compiling.decide([0.31, 0.32, 0.33, 0.32, 0.35], 54, None)
    assert not worth
    assert why == ("54 steps left x 0.320 s eager = 17 s; compiled (1.45x) that saves 5 s <= 90 s to compile "
                   "(assumed: none measured on this GPU model yet)")
    # the same steps for 1,000 steps repay it; a measured (warm-cache) cost is used where there is one
    assert compiling.decide([0.32] * 5, 1000, None)[0]
    worth, why = compiling.decide([0.32] * 5, 200, 15.0)
    assert worth and why.endswith("20 s > 15 s to compile (last measured on this GPU model)")
    assert not compiling.decide([0.32] * 5, 200, 25.0)[0]


def test_the_measured_compilation_is_a_store_record_per_gpu_model_layer_and_torch_version(tmp_path):
    record = compiling.cost_entry(tmp_path, "NVIDIA-H200-sm90", "qwen3-1024-torch2.11.0+cu130")
    assert record.path == tmp_path / compiling.COSTS / "NVIDIA-H200-sm90--qwen3-1024-torch2.11.0+cu130"
    assert compiling.recorded_cost(record) is None  # nothing measured yet
    assert compiling.recorded_cost(None) is None  # no cache given
    compiling.record_cost(record, 55.47)
    other = compiling.cost_entry(tmp_path, "NVIDIA-H200-sm90", "llama-4096-torch2.11.0+cu130")
    compiling.record_cost(other, 80.0)
    assert (compiling.recorded_cost(record), compiling.recorded_cost(other)) == (55.5, 80.0)
    manifest = json.loads(record.manifest_path.read_text())  # a record: its manifest holds it whole
    assert (manifest["kind"], manifest["files"], manifest["result"]) == (compiling.COSTS, {}, {"seconds": 55.5})
    assert [p.name for p in record.path.iterdir()] == ["manifest.json"]  # no temporary file left behind
    record.manifest_path.write_text('{"format": 1, "files": {}, "result": {"seco')  # torn: no measurement
    assert compiling.recorded_cost(record) is None
    compiling.record_cost(record, 12.0)
    compiling.record_cost(record, 14.0)  # the last measurement wins
    assert compiling.recorded_cost(record) == 14.0 and record.problem() is None


def train_tiny(tmp_path, steps: int, recorded: float | None):
    """A real Trainer on packed micro-batches with the `auto` callback as the training worker adds it; the layers'
    compilation on Dynamo's eager backend. Returns (callback, clock, lines it printed, model, record)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(tiny_qwen3(2).train(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules="all-linear", task_type="CAUSAL_LM"))
    model.config.use_cache = False
    use_packed_attention(model, "rows")
    record = compiling.cost_entry(tmp_path / "cache", "cpu", compiling.layer_key(model.config))
    if recorded is not None:
        compiling.record_cost(record, recorded)
    packs = [random_rows([5 + i % 7, 17, 9 + i % 3], seed=i) for i in range(steps)]
    collator = PackedCollator(0)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, max_steps=steps,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=5,
                             disable_tqdm=True, remove_unused_columns=False, train_sampling_strategy="sequential")
    trainer = Trainer(model=model, args=args, train_dataset=packs, data_collator=collator)
    clock = StepClock(collator, model)
    trainer.add_callback(_callbacks(steps, collator, clock, tmp_path, time.perf_counter()))
    lines: list[str] = []
    callback = compiling.compile_when_it_pays(model, clock, record, gather, lines.append, backend="eager")
    trainer.add_callback(callback)
    torch._dynamo.reset()
    try:
        trainer.train()
    finally:
        torch._dynamo.reset()
    return callback, clock, lines, model, record


def compiled(model) -> bool:
    return all(layer._compiled_call_impl is not None for layer in model.get_base_model().model.layers)


@pytest.mark.train
@pytest.mark.parametrize("steps,recorded,compiles", [
    (12, 0.0, True),  # compiling measured as free on this "GPU": worth it at once
    (12, 1e6, False),  # a compilation that 6 steps cannot repay
])
def test_auto_compiles_the_layers_mid_run_only_when_it_pays_and_records_what_it_took(tmp_path, steps, recorded,
                                                                                     compiles):
    callback, clock, lines, model, record = train_tiny(tmp_path, steps, recorded)
    # decided after the attempt's first step and MEASURE_STEPS timed eager ones: at step 6 of 12
    decided_at = 1 + compiling.MEASURE_STEPS
    assert lines[0].startswith(f"train.compile=auto at step {decided_at}: {steps - decided_at} steps left x ")
    assert compiled(model) is compiles
    excluded = [step for step, _, _, excluded in clock.steps if excluded]
    if compiles:
        assert lines[0].endswith("(last measured on this GPU model): compiling the decoder layers now")
        assert callback.summary()["compiled_at_step"] == decided_at
        cost = callback.summary()["compile_seconds"]
        assert cost is not None and cost >= 0 and lines[1].startswith("decoder layers compiled in ")
        assert compiling.recorded_cost(record) == round(cost, 1)
        assert excluded == [decided_at + 1]  # the step that compiled is not steady state
    else:
        assert lines == [lines[0]] and lines[0].endswith(": the layers stay eager")
        assert callback.summary() == {"compiled_at_step": None, "compile_seconds": None}
        assert compiling.recorded_cost(record) == 1e6  # nothing new measured
        assert excluded == []
    assert [step for step, *_ in clock.steps] == list(range(1, steps + 1))
    assert steady_state(clock.steps, 1.0, 2)["steps"] == steps - 2 - len(excluded)


def _record_many(cache: str, run: int) -> None:
    for i in range(20):
        compiling.record_cost(compiling.cost_entry(Path(cache), "cpu", f"run{run}-{i}"), float(i))
        compiling.record_cost(compiling.cost_entry(Path(cache), "cpu", "shared"), float(100 * run + i))


def test_runs_recording_at_once_keep_each_others_measurements(tmp_path):
    """Runs on one cache record compile times at the same time (real processes): every record survives whole, and
    one key written by all of them at once holds one writer's whole measurement."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_record_many, args=(str(tmp_path), n)) for n in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    entries = sorted((tmp_path / compiling.COSTS).iterdir())
    assert len(entries) == 3 * 20 + 1
    assert all(Entry(tmp_path, compiling.COSTS, e.name).problem() is None for e in entries)
    assert compiling.recorded_cost(compiling.cost_entry(tmp_path, "cpu", "shared")) in {
        float(100 * run + i) for run in range(3) for i in range(20)}


@pytest.mark.train
def test_stable_gradients_accumulate_into_buffers_of_their_own_and_train_the_same(tmp_path):
    """train.cuda_graphs: every step's micro-batches add their gradients into the same buffers, allocated once (the
    graphs' own output memory is overwritten by the next replay), and the adapter trains exactly as without them."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    packs = [random_rows([5 + i % 7, 17, 9 + i % 3], seed=i) for i in range(6)]

    def trained(stable: bool):
        model = get_peft_model(tiny_qwen3(2).train(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                               target_modules="all-linear", task_type="CAUSAL_LM",
                                                               init_lora_weights=False))
        model.config.use_cache = False
        use_packed_attention(model, "rows")
        seen: list[set[int]] = []

        class Grads(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                seen.append({id(p.grad) for p in model.parameters() if p.requires_grad})

        args = TrainingArguments(output_dir=str(tmp_path / f"out-{stable}"), per_device_train_batch_size=1,
                                 gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-2, use_cpu=True,
                                 report_to=[], save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
                                 train_sampling_strategy="sequential")
        trainer = Trainer(model=model, args=args, train_dataset=packs, data_collator=PackedCollator(0),
                          callbacks=[Grads()])
        callback = compiling.stable_gradients(model) if stable else None
        if callback is not None:
            trainer.add_callback(callback)
        trainer.train()
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        return weights, seen, callback

    plain, _, _ = trained(False)
    stable, seen, callback = trained(True)
    assert seen == [{id(b) for b in callback.gradients}] * 3  # each step's gradients, in the same buffers
    for name, weight in stable.items():
        torch.testing.assert_close(weight, plain[name], msg=name)


def worker_run(cache: Path, tmp_path: Path, name: str, env: dict[str, str] | None = None,
               **training) -> tuple[dict, dict, str]:
    """The real training worker (a child process, as torchrun starts a rank) on the tiny NF4 base and a pattern it
    can learn, under a hand-made training plan (`training`: TrainingPlan fields; the planner turns compiling and CUDA
    graphs off without a GPU), with `env` added to its environment: its metrics, adapter weights and printed lines."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    from conftest import child_env
    from eval_support import tiny_quantized
    from finetune_flows.config.plan import Plan
    from finetune_flows.config.schema import FinetuneConfig
    from finetune_flows.data.dataset import PreparedDataset
    from finetune_flows.training.planner import TrainingPlan
    from finetune_flows.training.train import write_train_job

    base = tiny_quantized(cache / "worker-runs", "float32")
    data_dir = tmp_path / "data"
    if not data_dir.is_dir():
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(8, 120, (64,), generator=gen).tolist()
        rows = [[3 + (first + i) % 40 for i in range(n)] for first, n in enumerate(lengths)]
        data_dir.mkdir()
        for split, part in (("train", rows[:48]), ("eval", rows[48:])):
            pq.write_table(pa.table({"input_ids": part, "labels": part}), data_dir / f"{split}.parquet")
    data = PreparedDataset(path=data_dir, fingerprint="worker-runs", format="text", train_rows=48, eval_rows=16,
                           train_tokens=1, truncated=0, dropped=0)
    cfg = FinetuneConfig.model_validate({"lora": {"dropout": 0.0}, "train": {
        "max_steps": 4, "logging_steps": 1, "learning_rate": 1e-2, "warmup_steps": 0, "per_device_batch_size": 8,
        "gradient_accumulation_steps": 1}})
    plan = Plan(device="cpu", nproc=1, precision="fp32", compute_dtype="float32", train_attn="sdpa", eval_attn="sdpa")
    tplan = TrainingPlan(**{**dict(packing=True, micro_batch_tokens=256, micro_batch_rows=0,
                                   gradient_accumulation_steps=2, gradient_checkpointing=True, tokens_per_step=500.0,
                                   predicted_peak_gib=0.0, budget_gib=None, reasons=[]), **training})
    out = tmp_path / name
    job = write_train_job(out, cfg, plan.with_training(tplan), base, data, [], name)
    done = subprocess.run([sys.executable, "-m", "finetune_flows.training.worker", str(job)],
                          env=child_env(**(env or {})), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((out / "train_metrics.json").read_text())
    return metrics, load_file(out / "adapter" / "adapter_model.safetensors"), done.stdout


COMPILED = dict(dequantize_base=True, compile_layers=True)


@pytest.fixture(scope="module")
def compiled_run(shared_cache, tmp_path_factory):
    """The dequantized base's layers compiled, on a compile cache of its own that starts empty: the reference run of
    the CUDA graphs' test and the first run of the compile cache's (the file runs on one test worker, so once)."""
    from types import SimpleNamespace

    tmp = tmp_path_factory.mktemp("compiled")
    caches = {"TORCHINDUCTOR_CACHE_DIR": str(tmp / "compile" / "inductor"),
              "TRITON_CACHE_DIR": str(tmp / "compile" / "triton")}
    return SimpleNamespace(caches=caches, result=worker_run(shared_cache, tmp, "first", env=caches, **COMPILED))


def assert_trained_alike(run: dict, adapter: dict, reference: dict, reference_adapter: dict) -> None:
    assert run["train_tokens"] == reference["train_tokens"]  # real tokens: padding is not counted
    for (step, loss), (_, want) in zip(run["loss_curve"], reference["loss_curve"], strict=True):
        assert loss == pytest.approx(want, rel=1e-4), step
    assert run["loss_curve"][-1][1] < run["loss_curve"][0][1] - 0.05  # it trained
    assert adapter.keys() == reference_adapter.keys()
    for name, weight in adapter.items():
        torch.testing.assert_close(weight, reference_adapter[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.train
def test_the_training_worker_trains_the_same_adapter_with_cuda_graphs_on(shared_cache, compiled_run, tmp_path):
    """train.cuda_graphs through the real training worker, with the plan the planner makes on a GPU (here it would turn
    them off: no GPU), checkpointing inside the graphs as within 24 GiB, two micro-batches a step: every micro-batch
    padded to one shape, one compilation for every layer and micro-batch, no graph break, and the same losses and
    adapter as the compiled run without them (on the CPU Inductor compiles the same static graphs, minus the CUDA
    graphs' recording)."""
    plain, plain_adapter, _ = compiled_run.result
    graphed, graphed_adapter, printed = worker_run(shared_cache, tmp_path, "graphs", cuda_graphs=True, **COMPILED)
    assert graphed["layout"].startswith("packed micro-batches of <= 256 tokens x 2 accumulation")
    assert graphed["layout"].endswith("CUDA graphs (each padded to 256 tokens)")
    assert "checkpointing on" in printed and "decoder layers compiled" in printed
    stats = graphed["compile_stats"]
    assert (stats["frames_compiled"], stats["graphs"], stats["graph_breaks"]) == (1, 1, 0), stats
    assert_trained_alike(graphed, graphed_adapter, plain, plain_adapter)


@pytest.mark.train
def test_the_training_worker_compiles_through_the_4bit_layers(shared_cache, tmp_path):
    """train.compile=true over a base kept 4-bit (too large to hold dequantized): bitsandbytes' dequantize and matmul
    trace into each layer's graph, one graph for every layer with no break, with dynamic shapes and with the static
    ones of CUDA graphs, and the adapter trains as on the eager 4-bit layers."""
    eager, eager_adapter, _ = worker_run(shared_cache, tmp_path, "eager-4bit")
    assert eager["compile_stats"] is None
    for name, graphs in (("compiled-4bit", False), ("graphs-4bit", True)):
        compiled, compiled_adapter, printed = worker_run(shared_cache, tmp_path, name, compile_layers=True,
                                                         cuda_graphs=graphs)
        assert "decoder layers compiled" in printed and "dequantized" not in printed
        stats = compiled["compile_stats"]
        assert (stats["frames_compiled"], stats["graphs"], stats["graph_breaks"]) == (1, 1, 0), (name, stats)
        assert_trained_alike(compiled, compiled_adapter, eager, eager_adapter)


@pytest.mark.train
def test_a_second_run_on_the_same_compile_cache_compiles_nothing(shared_cache, compiled_run, tmp_path):
    """Compiled layers' kernels persist in the compile cache (launcher.compile_caches puts it in the project's cache,
    per GPU model): a second run of the same layers loads both of Inductor's graphs (forward and backward) from it
    instead of compiling them, trains the same adapter, and its metrics and log say so."""
    first, first_adapter, first_log = compiled_run.result
    second, second_adapter, second_log = worker_run(shared_cache, tmp_path, "second", env=compiled_run.caches,
                                                    **COMPILED)
    assert (first["compile_stats"]["cache_hits"], first["compile_stats"]["cache_misses"]) == (0, 2)
    assert (second["compile_stats"]["cache_hits"], second["compile_stats"]["cache_misses"]) == (2, 0)
    assert "Inductor graphs 0 from the compile cache, 2 compiled" in first_log
    assert "Inductor graphs 2 from the compile cache, 0 compiled" in second_log
    assert_trained_alike(second, second_adapter, first, first_adapter)
