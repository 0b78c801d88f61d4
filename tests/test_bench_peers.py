"""The training bench's peer rows (Unsloth, TRL) and memory budgets: the report side, on the CPU.

The peers themselves need a GPU (Unsloth refuses to import without one; TRL 1.15's fused LM head is a Triton kernel),
so what runs here is the bench's handling of their rows: the ratio against the fastest peer per shape and budget,
rows that failed kept with their error, and the budget list.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, child_env, load_benchmark


def row(name: str, run: str, shape: str, speed: float | None, budget: int | None = None, **extra) -> dict:
    base = {"name": name, "run": run, "shape": shape, "memory_budget_gib": budget, "model": f"generated:{shape}",
            "gpus": 1, "tokens_per_second": speed, "tokens_per_second_min": speed, "tokens_per_second_max": speed,
            "mfu": None, "peak_reserved_gib": 1.0, "nvidia_smi_peak_gib": 1.2, "eval_loss": 2.0, "layout": run}
    return {**base, **extra}


def report_of(bench, state, runs: list[dict]) -> dict:
    """The report build_report makes of these rows in a --state directory, with no GPUs."""
    from types import SimpleNamespace

    (state / "runs").mkdir()
    for r in runs:
        (state / "runs" / f"{r['name']}.json").write_text(json.dumps(r))
    return bench.build_report(state, SimpleNamespace(gpus=[], driver_version=None, cuda_version=None), "cmd")


def test_ours_over_the_fastest_peer_per_shape_and_budget_and_failed_rows_keep_their_error(tmp_path):
    bench = load_benchmark("train_report")
    runs = [row("ours-qwen3-0.6b", "ours", "qwen3-0.6b", 100.0), row("trl-qwen3-0.6b", "trl", "qwen3-0.6b", 40.0),
            row("unsloth-qwen3-0.6b", "unsloth", "qwen3-0.6b", 50.0),
            row("trl-bf16-qwen3-0.6b", "trl-bf16", "qwen3-0.6b", None,
                error="RuntimeError: peer exited 1:\ntorch.OutOfMemoryError: CUDA out of memory"),
            # a budget's rows are compared only with each other: the unlimited trl row is faster but not counted
            row("ours-qwen3-8b-24gib", "ours", "qwen3-8b", 30.0, 24),
            # a variant of ours gets its own ratios, against the same seed and peers; a two-GPU one none
            row("ours-cg-qwen3-8b-24gib", "ours-cg", "qwen3-8b", 36.0, 24, eval_loss=2.2),
            row("seed-qwen3-8b-24gib", "seed", "qwen3-8b", 3.0, 24),
            row("ours-2gpu-cg-qwen3-8b-24gib", "ours-2gpu-cg", "qwen3-8b", 60.0, 24, gpus=2),
            row("unsloth-qwen3-8b-24gib", "unsloth", "qwen3-8b", 12.0, 24),
            row("trl-qwen3-8b", "trl", "qwen3-8b", 60.0),
            # a peer without an ours row of its shape and budget gives no ratio
            row("trl-qwen3-8b-12gib", "trl", "qwen3-8b", 5.0, 12),
            # a long error: its first line (what failed) and its tail both shown
            row("unsloth-qwen3-8b", "unsloth", "qwen3-8b", None,
                error="\n".join(["WorkerOOM: train worker exited with code 1; last output:",
                                  *(f"torchrun line {i}" for i in range(40)), "CUDA out of memory. Tried 120 MiB"]))]
    report = report_of(bench, tmp_path, runs)
    assert report["speedup"]["vs_best_peer"] == {"qwen3-0.6b": 2.0, "qwen3-8b-24gib": 2.5,
                                                 "qwen3-8b-24gib:cg": 3.0}
    assert report["best_peer"] == {"qwen3-0.6b": "unsloth-qwen3-0.6b", "qwen3-8b-24gib": "unsloth-qwen3-8b-24gib",
                                   "qwen3-8b-24gib:cg": "unsloth-qwen3-8b-24gib"}
    assert report["speedup"]["qwen3-8b-24gib"] == 10.0 and report["speedup"]["qwen3-8b-24gib:cg"] == 12.0
    assert report["eval_loss_relative_to_seed"]["qwen3-8b-24gib:cg"] == 0.1
    assert report["speedup"]["ddp_2gpu_scaling:cg-24gib"] == pytest.approx(1.67)
    md = bench.markdown(report)
    table = md.split("## Rows that did not run")[0]
    assert "| trl-bf16-qwen3-0.6b |" not in table and "| ours-qwen3-8b-24gib | 24 |" in table
    assert "**trl-bf16-qwen3-0.6b** (budget none)" in md and "torch.OutOfMemoryError: CUDA out of memory" in md
    long = md.split("**unsloth-qwen3-8b** (budget none):")[1].split("```")[1].splitlines()
    assert long[1:3] == ["WorkerOOM: train worker exited with code 1; last output:", "..."]
    assert long[-1] == "CUDA out of memory. Tried 120 MiB" and len(long) == 26, long
    assert "- qwen3-8b-24gib: 2.5 (against unsloth-qwen3-8b-24gib)" in md
    assert "- qwen3-8b-24gib:cg: 3.0 (against unsloth-qwen3-8b-24gib)" in md
    assert report["across_machines"] == [] and "different machines" not in md  # every row from this call


def test_a_ratio_whose_rows_ran_on_different_machines_says_so(tmp_path):
    """Calls joined by --resume-from may pair rows from two machines of the same card: the report names those ratios
    (by GPU UUID; a joined row without one counts as its own report's machine)."""
    bench = load_benchmark("train_report")
    old = {"report": "benchmarks/results/old/report.json", "date": "20261201-000000"}
    runs = [row("ours-qwen3-8b", "ours", "qwen3-8b", 100.0, machine="GPU-a"),
            row("ours-fp8-qwen3-8b", "ours-fp8", "qwen3-8b", 120.0, machine="GPU-b"),
            row("seed-qwen3-8b", "seed", "qwen3-8b", 10.0, machine="GPU-a"),
            row("unsloth-qwen3-8b", "unsloth", "qwen3-8b", 50.0, machine="GPU-a"),
            row("ours-qwen3-0.6b", "ours", "qwen3-0.6b", 90.0, machine="GPU-a"),
            row("seed-qwen3-0.6b", "seed", "qwen3-0.6b", 3.0, machine=None, joined_from=old),
            row("trl-qwen3-0.6b", "trl", "qwen3-0.6b", 30.0, machine="GPU-a")]
    report = report_of(bench, tmp_path, runs)
    assert sorted(report["across_machines"]) == ["qwen3-0.6b", "qwen3-8b:fp8", "vs_best_peer:qwen3-8b:fp8"]
    md = bench.markdown(report)
    assert "- qwen3-8b: 10.0\n" in md and "- qwen3-0.6b: 30.0 (the two rows ran on different machines)" in md
    assert "- qwen3-8b:fp8: 2.4 (against unsloth-qwen3-8b) (the two rows ran on different machines)" in md
    assert "- qwen3-8b: 2.0 (against unsloth-qwen3-8b)\n" in md


def test_budgets_are_none_or_whole_gib_and_name_the_rows():
    bench = load_benchmark("train_speed")
    assert bench.parse_budgets("none,24") == [None, 24]
    assert bench.parse_budgets("") == [None]
    with pytest.raises(SystemExit, match="'12gib' is neither 'none' nor a whole number of GiB"):
        bench.parse_budgets("none,12gib")
    assert bench.budget_suffix(None) == "" and bench.budget_suffix(12) == "-12gib"


def test_a_peer_batch_size_divides_the_effective_batch_and_its_row_counts_for_the_fastest_peer(tmp_path):
    bench = load_benchmark("train_speed")
    assert bench.parse_peer_rows("8,32", 32) == [8, 32] and bench.parse_peer_rows("", 32) == [8]
    for bad in ("12", "0", "32x"):
        with pytest.raises(SystemExit, match=f"--peer-rows: '{bad}' is not a whole number of rows dividing"):
            bench.parse_peer_rows(bad, 32)
    assert bench.peer_label("unsloth", 8) == "unsloth" and bench.peer_label("unsloth", 32) == "unsloth-r32"
    runs = [row("ours-qwen3-8b", "ours", "qwen3-8b", 90.0), row("unsloth-qwen3-8b", "unsloth", "qwen3-8b", 20.0),
            row("unsloth-r32-qwen3-8b", "unsloth", "qwen3-8b", 45.0, rows_per_micro_batch=32),
            row("trl-qwen3-8b", "trl", "qwen3-8b", 30.0)]
    report = report_of(load_benchmark("train_report"), tmp_path, runs)
    assert report["speedup"]["vs_best_peer"] == {"qwen3-8b": 2.0}
    assert report["best_peer"] == {"qwen3-8b": "unsloth-r32-qwen3-8b"}


def test_a_peer_batch_that_does_not_divide_the_effective_batch_stops_the_bench_before_anything_runs():
    proc = subprocess.run([sys.executable, "benchmarks/train_speed.py", "--runs", "unsloth", "--peer-rows", "8,12"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--peer-rows: '12' is not a whole number of rows dividing" in proc.stderr
    assert "base model ready" not in proc.stdout


def test_an_unknown_run_stops_the_bench_before_anything_runs():
    proc = subprocess.run([sys.executable, "benchmarks/train_speed.py", "--runs", "ours,axolotl"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown run(s) axolotl" in proc.stderr
    assert "base model ready" not in proc.stdout


def test_the_peers_token_count_is_their_rows_real_tokens_whatever_their_collator_makes_of_them():
    import torch

    peers = load_benchmark("peer_recipe")
    seen = []
    counter = peers.TokenCounter(
        lambda rows: seen.append(len(rows)) or {"flat": sum(len(r["input_ids"]) for r in rows)})
    model = torch.nn.Identity()
    counter.count_on(model)  # each batch's tokens count when the model runs it
    assert counter([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]) == {"flat": 4}
    counter([{"input_ids": [5, 6]}])
    assert counter.tokens == 0 and seen == [2, 1]
    model(torch.zeros(1))
    assert counter.tokens == 4
    model(torch.zeros(1))
    assert counter.tokens == 6


@pytest.mark.slow
def test_a_peer_that_fails_is_a_row_with_its_error_and_the_seed_still_runs(tmp_path):
    """On this CPU the TRL peer cannot train (its site here has no TRL, or TRL's fused LM head finds no Triton): the
    report keeps the row with the peer's own last lines, the seed recipe runs after it, the exit status is 1. With
    `--peer-rows 4` the peer's job batches 4 rows a micro-step over twice the accumulation (the smoke's 8 x 1)."""
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "benchmarks/train_speed.py", "--smoke", "--runs", "trl,seed", "--state",
                           str(tmp_path / "state"), "--out", str(out), "--peer-rows", "4"], cwd=REPO,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    by = {r["name"]: r for r in report["runs"]}
    assert by["seed-tiny-llama"]["tokens_per_second"] > 0
    failed = by["trl-r4-tiny-llama"]
    assert failed["error"].startswith("RuntimeError: ") and failed["tokens_per_second"] is None
    assert (failed["run"], failed["rows_per_micro_batch"]) == ("trl", 4)  # as a row that ran names itself
    job = json.loads((tmp_path / "state" / "out" / "trl-r4-tiny-llama" / "job.json").read_text())
    assert (job["rows_per_micro_batch"], job["gradient_accumulation_steps"]) == (4, 2)
    last = (tmp_path / "state" / "out" / "trl-r4-tiny-llama" / "train.log").read_text().strip().splitlines()[-1]
    assert last in failed["error"] and last in (out / "report.md").read_text()


def test_an_earlier_calls_rows_join_the_state_without_replacing_what_is_there(tmp_path):
    bench = load_benchmark("train_report")
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"runs": [row("ours-qwen3-8b", "ours", "qwen3-8b", 10.0, host="a"),
                                            row("trl-qwen3-8b", "trl", "qwen3-8b", 5.0, host="a")],
                                   "gpus": [{"name": "NVIDIA H200"}],
                                   "workload": {"qwen3-8b-4000-from151669": {"rows": 4000}}}))
    state = tmp_path / "state"
    (state / "runs").mkdir(parents=True)
    (state / "runs" / "trl-qwen3-8b.json").write_text(json.dumps(row("trl-qwen3-8b", "trl", "qwen3-8b", 6.0, host="b")))
    with pytest.raises(ValueError, match=r"ran on \['NVIDIA H200'\], this host has \['NVIDIA H100 80GB HBM3'\]"):
        bench.resume_rows(earlier, state, ["NVIDIA H100 80GB HBM3"])
    assert not (state / "runs" / "ours-qwen3-8b.json").exists()
    assert bench.resume_rows(earlier, state, ["NVIDIA H200"]) == 1
    assert json.loads((state / "runs" / "trl-qwen3-8b.json").read_text())["host"] == "b"
    assert json.loads((state / "runs" / "ours-qwen3-8b.json").read_text())["host"] == "a"
    from types import SimpleNamespace

    report = bench.build_report(state, SimpleNamespace(gpus=[], driver_version=None, cuda_version=None), "cmd")
    assert report["workload"] == {"qwen3-8b-4000-from151669": {"rows": 4000}}
    assert report["speedup"]["vs_best_peer"] == {"qwen3-8b": 1.67}
    # the joined row names where it came from, and the report says which rows ran where
    assert json.loads((state / "runs" / "ours-qwen3-8b.json").read_text())["joined_from"] == {
        "report": str(earlier), "date": None}
    assert "joined_from" not in json.loads((state / "runs" / "trl-qwen3-8b.json").read_text())
    where = "\n".join(bench._where_rows_ran(report))  # a section of the report's markdown
    assert f"joined from `{earlier}` (undated): ours-qwen3-8b" in where and "not recorded: trl-qwen3-8b" in where


def test_a_peers_trainer_is_clocked_like_ours_and_counts_the_tokens_its_model_ran(tmp_path):
    """The peers cannot train here, but their clock wiring (peer_recipe.clocked: the seed's and ours' StepClock) runs
    on a real Trainer: one timed interval per optimizer step, each with the real tokens of the rows its model ran."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from finetune_flows.data.packing import PadCollator

    recipe = load_benchmark("peer_recipe")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    lengths = [5, 7, 3, 9, 4, 6, 8, 2]
    rows = [{"input_ids": [1 + i] * n, "labels": [1 + i] * n} for i, n in enumerate(lengths)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=2, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False, train_sampling_strategy="sequential")
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=PadCollator(0))
    counter, clock = recipe.clocked(trainer)
    trainer.train()
    assert [(step, tokens) for step, _, tokens, _ in clock.steps] == [(1, sum(lengths[:4])), (2, sum(lengths[4:]))]
    assert counter.tokens == sum(lengths) and all(seconds > 0 for _, seconds, _, _ in clock.steps)


def test_each_trl_row_sets_its_own_base_batches_and_checkpointing():
    """The TRL rows differ in one setting each from `trl`: the bf16 base, or TRL's default padded batches; gradient
    checkpointing follows the budget, Liger the GPU. The report counts the same peers the recipe runs."""
    recipe, report = load_benchmark("peer_recipe"), load_benchmark("train_report")
    assert report.PEERS == recipe.PEERS
    settings = {peer: recipe.trl_settings(peer, {"memory_budget_gib": None}, True)
                for peer in ("trl", "trl-padded", "trl-bf16")}
    assert settings == {
        "trl": {"bf16_base": False, "padding_free": True, "use_liger_kernel": True, "gradient_checkpointing": False},
        "trl-padded": {"bf16_base": False, "padding_free": False, "use_liger_kernel": True,
                       "gradient_checkpointing": False},
        "trl-bf16": {"bf16_base": True, "padding_free": True, "use_liger_kernel": True, "gradient_checkpointing": False}}
    budgeted = recipe.trl_settings("trl-padded", {"memory_budget_gib": 24}, False)
    assert budgeted["gradient_checkpointing"] and not budgeted["use_liger_kernel"]


def test_the_unsloth_row_imports_unsloth_before_anything_imports_transformers(tmp_path):
    """Unsloth patches transformers fully only when it is imported first (it warns "Unsloth should be imported before
    [transformers]" and may run slower otherwise). It refuses to import without a GPU, so a stand-in on the path stops
    the recipe at that import and says what was imported before it."""
    stand_in = tmp_path / "site" / "unsloth"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(
        "import sys\n"
        "raise SystemExit('before unsloth: ' + repr(sorted({'torch', 'transformers'} & set(sys.modules))))\n")
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"peer": "unsloth"}))
    proc = subprocess.run([sys.executable, "benchmarks/peer_recipe.py", str(job)], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=child_env(PYTHONPATH=str(tmp_path / "site")))
    assert proc.returncode != 0 and "before unsloth: []" in proc.stderr, proc.stderr[-2000:]


def test_the_seed_recipe_runs_within_the_rows_memory_budget_as_the_peers_do(tmp_path, monkeypatch):
    """A budget's seed row (`seed-<shape>-<N>gib`) is the recipe capped at N GiB, as the peers are: an uncapped seed
    under a budget's name would pair ours within the budget with a recipe that used all the GPU. No GPU here: the
    cap is read off a stand-in for torch.cuda, and loading the model stops the recipe."""
    import importlib

    import torch
    import transformers

    importlib.import_module("peft")  # before torch.cuda claims a GPU: bitsandbytes, which peft imports, would use it
    seed = load_benchmark("seed_recipe")
    caps = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 96 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i=None: caps.append((f, i)))

    class Loaded(Exception):
        pass

    def load(*a, **k):
        raise Loaded(caps[:])

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"out": str(tmp_path), "model": "m", "seed": 42, "memory_budget_gib": 24}))
    with pytest.raises(Loaded) as loaded:
        seed.main(str(job))
    assert loaded.value.args[0] == [(0.25, 0)]  # capped before the model loads
    caps.clear()
    job.write_text(json.dumps({"out": str(tmp_path), "model": "m", "seed": 42, "memory_budget_gib": None}))
    with pytest.raises(Loaded):
        seed.main(str(job))
    assert caps == []


def test_a_recipes_row_keeps_each_steps_seconds_as_ours_does(tmp_path):
    """The seed's and the peers' rows (train_timed) keep every step's time as ours' rows do (`step_seconds`), so a
    row whose 5-step windows spread (a peer's 8,306..13,319 tokens/s) can be read step by step like ours."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from finetune_flows.data.packing import PadCollator

    recipe = load_benchmark("peer_recipe")
    seed = load_benchmark("seed_recipe")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    rows = [{"input_ids": [1 + i] * (2 + i), "labels": [1 + i] * (2 + i)} for i in range(12)]
    args = TrainingArguments(output_dir=str(tmp_path / "ckpt"), per_device_train_batch_size=2, max_steps=6,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=PadCollator(0))
    counter, clock = recipe.clocked(trainer)
    result = seed.train_timed(trainer, counter, clock, 1, tmp_path)
    assert len(result["step_seconds"]) == result["steps"] == 6
    assert result["step_seconds"] == [round(sec, 4) for _, sec, _, _ in clock.steps]
