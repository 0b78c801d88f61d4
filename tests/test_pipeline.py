"""The real pipeline on a tiny generated model, through the real Prefect engine (one test server per session)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from flows.finetune import finetune, main
from finetune_flows.errors import DataError
from finetune_flows.reporting.summary import render_summary

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def first_run(prefect_server, shared_cache, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    return finetune(tiny_config(shared_cache / "pipeline", runs, **{"export.merge": True})), runs


def artifacts_of_latest_flow_run() -> dict[str, str]:
    """The latest flow run's keyed artifacts: key -> content."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        return {a.key: str(a.data) for a in arts if a.key}


def test_whole_flow_produces_an_evaluated_adapter(first_run):
    result, runs = first_run
    run_dir = result.run_dir
    assert run_dir.parent == runs
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    assert resolved["model"]["source"] == "generated:tiny-llama" and resolved["train"]["max_steps"] == 6
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    assert (run_dir / "adapter" / "adapter_model.safetensors").stat().st_size > 0
    assert "GPUs" in (run_dir / "environment.md").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["cached_steps"] == []
    steps = summary["step_seconds"]  # each step's wall time: the summary, the CLI's table, the step-cache artifact
    assert list(steps) == ["prepare-dataset", "quantize-base-model", "train-adapter", "evaluate-adapter",
                           "merge-adapter"]
    assert "- step seconds: prepare-dataset " in render_summary(result)
    train = result.train
    # each a step's own time: the training step's holds its worker's training (a worker forked from the fork server
    # can train these 6 steps faster than the dataset step ran on a loaded host, so the steps are not compared)
    assert all(s > 0 for s in steps.values()) and steps["train-adapter"] >= train.train_seconds
    assert train.steps == 6 and train.world_size == 1 and train.device == "cpu"
    assert len(train.loss_curve) == 6 and train.tokens_per_second > 0 and train.peak_memory_mb > 0
    assert train.final_loss < train.first_loss  # lr 1e-3 on a fixed task: the loss must fall
    report = result.eval
    assert report.attn_implementation == "sdpa" and report.eval_rows == 12
    assert report.base.generated == report.adapter.generated == 8
    assert report.adapter.loss < report.base.loss  # the adapter learned something measurable on held-out rows
    assert {"environment-report", "train-progress", "train-loss", "eval-metrics", "eval-samples",
            "adapter-location", "run-summary", "step-cache", "training-plan"} <= set(artifacts_of_latest_flow_run())


def test_second_identical_run_is_served_from_cache(first_run, shared_cache):
    result, runs = first_run
    manifest = Path(result.train.adapter_path).parent / "manifest.json"  # the adapter's store entry
    committed = manifest.stat().st_mtime_ns
    again = finetune(tiny_config(shared_cache / "pipeline", runs, **{"export.merge": True}))
    assert again.cached_steps == ["prepare-dataset", "quantize-base-model", "train-adapter", "evaluate-adapter",
                                  "merge-adapter"]
    assert again.merged.path != result.merged.path and again.merged.logit_error == result.merged.logit_error
    assert again.run_dir != result.run_dir and (result.run_dir / "summary.json").is_file()  # earlier run untouched
    # the plan shown is the one the adapter was trained with, not one made again on this machine today
    plan = artifacts_of_latest_flow_run()["training-plan"]
    assert plan.startswith("# Training plan (the cached adapter's)")
    assert f"| micro_batch_tokens | {result.train.training_plan.micro_batch_tokens} |" in plan
    assert again.eval.adapter.loss == result.eval.adapter.loss
    # read back, not trained: the entry is as the first run committed it (wall time is no witness: the run's Prefect
    # round trips, tag concurrency slots among them, can outlast the tiny training on a loaded host)
    assert manifest.stat().st_mtime_ns == committed and again.train.adapter_path == result.train.adapter_path


def test_changing_a_training_hyperparameter_retrains_only(first_run, shared_cache):
    _, runs = first_run
    changed = finetune(tiny_config(shared_cache / "pipeline", runs, **{"train.learning_rate": 5e-4}))
    assert changed.cached_steps == ["prepare-dataset", "quantize-base-model"]


def test_another_evaluation_backend_reevaluates_the_same_adapter_without_retraining(first_run, shared_cache):
    result, runs = first_run
    eager = finetune(tiny_config(shared_cache / "pipeline", runs, **{"eval.attn_implementation": "eager"}))
    assert eager.cached_steps == ["prepare-dataset", "quantize-base-model", "train-adapter"]
    assert eager.train.output_dir == result.train.output_dir  # the very adapter the sdpa evaluation scored
    assert (eager.eval.attn_implementation, result.eval.attn_implementation) == ("eager", "sdpa")
    assert eager.eval.adapter.loss == pytest.approx(result.eval.adapter.loss, rel=1e-4)
    # written as the backend it resolves to, the evaluation is the cached sdpa one
    same = finetune(tiny_config(shared_cache / "pipeline", runs, **{"eval.attn_implementation": "sdpa"}))
    assert same.cached_steps[-1] == "evaluate-adapter" and same.eval.path == result.eval.path


def test_references_longer_than_the_answers_may_be_are_counted_and_explained(first_run, shared_cache):
    """A reference longer than eval.max_new_tokens cannot match however good the answer: it was scored as a miss
    without a word, and the explanation called it ability."""
    from transformers import AutoTokenizer

    result, runs = first_run
    short = finetune(tiny_config(shared_cache / "pipeline", runs, **{"eval.max_new_tokens": 1}))
    tokenizer = AutoTokenizer.from_pretrained(short.adapter_path)
    lengths = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in short.eval.references]
    assert short.eval.long_references == sum(n > 1 for n in lengths) > 0 and short.eval.max_new_tokens == 1
    assert f"{short.eval.long_references} reference(s) are longer than eval.max_new_tokens=1 tokens" in \
        short.eval.explanation


def test_deleted_cache_outputs_are_rebuilt_not_trusted(first_run, shared_cache):
    import shutil

    result, runs = first_run
    shutil.rmtree(Path(result.eval.path).parent)
    again = finetune(tiny_config(shared_cache / "pipeline", runs))
    assert "evaluate-adapter" not in again.cached_steps and Path(again.eval.path).is_file()


def test_text_data_trains_evaluates_and_merges(prefect_server, shared_cache, tmp_path):
    """Plain-text rows: every token is learned, there is nothing to answer, and the merge is checked on the held-out
    rows themselves."""
    data = tmp_path / "notes.jsonl"
    data.write_text("".join(json.dumps({"text": f"note {i}: the printer on floor {i % 4} is out of toner"}) + "\n"
                            for i in range(40)))
    result = finetune(tiny_config(shared_cache / "pipeline", tmp_path / "runs",
                                  **{"data.source": str(data), "export.merge": True}))
    assert result.eval.adapter.generated == result.eval.base.generated == 0 and result.eval.eval_rows > 0
    assert result.merged.check_prompts > 0 and result.merged.top1_agreement > 0.9
    assert "merge-adapter" in result.step_seconds


def test_bad_data_row_stops_before_any_model_is_loaded(prefect_server, shared_cache, tmp_path):
    data = tmp_path / "tickets.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"tickets.jsonl: 1 malformed row\(s\): line 2"):
        finetune(tiny_config(cache, tmp_path / "runs", **{"data.source": str(data)}))
    assert not (cache / "quantized").exists() and not (cache / "adapters").exists()


def test_cli_reports_bad_input_in_one_message_and_exits_2(tmp_path, capsys):
    not_a_model = tmp_path / "model"
    not_a_model.mkdir()
    assert main(["--set", f"model.source={not_a_model}"]) == 2
    assert "directory without config.json" in capsys.readouterr().err
    assert main(["--set", "train.lerning_rate=1", "--set", "data.eval_fraction=2"]) == 2
    err = capsys.readouterr().err
    assert "train.lerning_rate: unknown key" in err and "data.eval_fraction" in err


def test_four_bit_checkpoint_loads_as_bitsandbytes_layers(first_run):
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM

    from finetune_flows.models.quantize import QuantizedModel

    result, _ = first_run
    quantized = [p for p in Path(result.train.output_dir).parent.parent.glob("quantized/*/quantization.json")]
    assert quantized
    q = QuantizedModel.model_validate_json(quantized[0].read_text())
    assert q.load_in_4bit and q.linear4bit_layers == 14
    model = AutoModelForCausalLM.from_pretrained(q.path, device_map={"": "cpu"}, dtype=torch.float32)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 14
    assert layers[0].weight.quant_state.quant_type == "nf4" and layers[0].weight.dtype == torch.uint8


def test_resume_skips_a_checkpoint_left_half_written_or_missing_a_file(tmp_path):
    from finetune_flows.training.checkpoints import last_checkpoint, write_checkpoint_manifest

    ckpts = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        ckpt = ckpts / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text("{}")
        (ckpt / "adapter_model.safetensors").write_bytes(b"weights" * step)
        if step != 15:
            write_checkpoint_manifest(ckpt)  # the Trainer finished saving it
    (ckpts / "checkpoint-10" / "adapter_model.safetensors").unlink()  # a file lost after the save
    # checkpoint-15: killed while saving, so no manifest
    assert last_checkpoint(ckpts) == ckpts / "checkpoint-5"
    assert not (ckpts / "checkpoint-10").exists() and not (ckpts / "checkpoint-15").exists()
    assert last_checkpoint(tmp_path / "none") is None


def test_run_directory_holds_plots_logs_and_the_merged_model(first_run):
    result, _ = first_run
    run_dir = result.run_dir
    assert result.plots == [run_dir / "plots" / "loss.png", run_dir / "plots" / "eval.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in result.plots)
    assert list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    merged = result.merged
    assert merged is not None and merged.path == run_dir / "merged" and merged.dtype == "bfloat16"
    weights = run_dir / "merged" / "model.safetensors"
    assert weights.stat().st_ino == (merged.cache_path / "model.safetensors").stat().st_ino  # linked, not copied
    card = (run_dir / "merged" / "README.md").read_text()
    assert "base_model: generated:tiny-llama" in card and "| base + adapter |" in card and "| transformers |" in card
    assert f"python flows/finetune.py --config {run_dir / 'config.resolved.yaml'}" in card
    assert re.search(r"data fingerprint `[0-9a-f]{24}`", card) and "## Merge check" in card
    assert "nothing to compare with yet" in (run_dir / "comparison.md").read_text()
    assert {"loss-curve", "eval-comparison", "eval-vs-previous", "merged-model"} <= artifact_keys_naming(run_dir.name)


def artifact_keys_naming(text: str) -> set[str]:
    """Keys of the recent markdown artifacts whose content names `text` (a run directory), whichever flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterType
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["markdown"])),
                                      sort=ArtifactSort.CREATED_DESC, limit=200)
    return {a.key for a in found if a.key and isinstance(a.data, str) and text in a.data}


def test_consecutive_runs_are_compared_in_the_ui_and_on_the_command_line(first_run, shared_cache, tmp_path, capsys):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from finetune_flows.reporting.compare import main as compare

    first = finetune(tiny_config(shared_cache / "pipeline", tmp_path))
    second = finetune(tiny_config(shared_cache / "pipeline", tmp_path, **{"train.learning_rate": 5e-4}))
    assert first.previous_run is None and second.previous_run == first.run_dir
    text = (second.run_dir / "comparison.md").read_text()
    assert f"Previous run: `{first.run_dir.name}`" in text
    row = next(line for line in text.splitlines() if line.startswith("| adapter: held-out loss |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) == pytest.approx(first.eval.adapter.loss, rel=1e-3)
    assert float(cells[2]) == pytest.approx(second.eval.adapter.loss, rel=1e-3)
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["eval-vs-previous"])), limit=1,
            sort=ArtifactSort.CREATED_DESC)
    assert artifact.data == text
    assert compare([str(second.run_dir)]) == 0 and capsys.readouterr().out.strip() == text.strip()
    assert compare(["--output-dir", str(tmp_path)]) == 0 and capsys.readouterr().out.strip() == text.strip()


def test_export_flow_merges_an_existing_adapter(first_run, capsys):
    from flows.export import main as export_main

    result, runs = first_run
    assert export_main(["--adapter", str(result.adapter_path)]) == 0
    (export_dir,) = runs.glob("tiny-export-*")
    merged = export_dir / "merged"
    assert f"merged checkpoint: {merged}" in capsys.readouterr().out
    # The same base, adapter and settings as the fine-tune run's own export: the cached checkpoint, linked again.
    weights = merged / "model.safetensors"
    assert weights.stat().st_ino == (result.merged.cache_path / "model.safetensors").stat().st_ino
    card = (merged / "README.md").read_text()
    assert f"| base + adapter | {result.eval.table()[1]['eval loss']} |" in card  # the adapter's run's eval table
    assert f"python flows/export.py --adapter {result.adapter_path}" in card


def test_an_export_with_another_config_names_the_training_data_on_its_card(first_run, tmp_path, capsys):
    """`export.py --adapter A --set data.source=B`: the card said the adapter was trained on B, and showed B's
    config as the training's."""
    from flows.export import main as export_main
    from finetune_flows.data.demo import ticket_triage

    result, runs = first_run
    data = tmp_path / "other.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ticket_triage(60, seed=5)))
    assert export_main(["--adapter", str(result.adapter_path), "--set", f"data.source={data}",
                        "--set", "data.format=instruction"]) == 0
    out = capsys.readouterr().out
    card = (Path(out.split("model card: ")[1].split()[0])).read_text()
    assert "- trained on `builtin:ticket-triage` (the training run's" in card
    assert f"- the merge below was checked on held-out rows of `{data}` (this export's config)" in card
    configuration = card.split("## Configuration")[1]
    assert "source: builtin:ticket-triage" in configuration and "its `export` and `quantization` sections" in card


def test_evaluate_flow_scores_the_merged_checkpoint_beside_base_and_adapter(first_run, capsys):
    """`flows/evaluate.py --merged runs/<run>/merged`: the merged row next to base + adapter, on the same rows."""
    from flows.evaluate import main as evaluate_main
    from finetune_flows.evaluation.adapters import EvaluationResult
    from finetune_flows.evaluation.evaluate import EvalReport, checkpoint_fingerprint

    result, runs = first_run
    merged = result.run_dir / "merged"
    card = (merged / "README.md").read_text()
    assert f"python flows/evaluate.py --merged {merged}" in card
    assert evaluate_main(["--merged", str(merged)]) == 0
    assert f"# Evaluation of {merged}" in capsys.readouterr().out
    (done,) = [p for p in runs.glob("tiny-eval-*/evaluation.json")
               if EvaluationResult.model_validate_json(p.read_text()).merged_path == merged]
    evaluation = EvaluationResult.model_validate_json(done.read_text())
    report = evaluation.eval
    assert evaluation.adapter_path == result.run_dir / "adapter"  # named by the card, evaluated beside it
    assert [row["model"] for row in report.table()] == ["base", "base + adapter", "merged"]
    # The adapter's rows are the fine-tune run's own evaluation (same inputs, so the same store entry).
    for ours, theirs in ((report.base, result.eval.base), (report.adapter, result.eval.adapter)):
        assert ours.loss == pytest.approx(theirs.loss, rel=1e-6) and ours.generation_score == theirs.generation_score
    # The checkpoint's own entry scored the base too, on the same rows with the same engine: the same number.
    alone = EvalReport.model_validate_json(Path(report.path).read_text())
    assert alone.adapter is None and alone.base.loss == pytest.approx(report.base.loss, rel=1e-6)
    # The merged model computes what base + adapter computes, up to its weights rounded to bf16 (export.dtype):
    # held-out loss within 0.1% (measured: 6.71874 vs 6.71879, 8e-6 relative; the base is 2.8% away) and the
    # same greedy answers (after 6 steps the tiny model's answers are alike for every model: the loss is the test).
    assert report.merged.loss == pytest.approx(report.adapter.loss, rel=1e-3)
    assert abs(report.merged.loss - report.base.loss) > 10 * abs(report.merged.loss - report.adapter.loss)
    assert report.merged.generated == report.adapter.generated == 8
    assert report.predictions["merged"] == report.predictions["adapter"]
    assert report.merged.generation_score == report.adapter.generation_score
    assert json.loads((done.parent / "eval.json").read_text())["merged"]["loss"] == report.merged.loss
    # Keyed by content: the cache entry it was linked from is the same checkpoint; the card is not part of it.
    assert checkpoint_fingerprint(merged) == checkpoint_fingerprint(result.merged.cache_path)
