"""Ship it: the adapter merged into the exact 4-bit base it was trained on (CPU, tiny generated model).

The export worker runs as in production (`python -m finetune_flows.export.merge job.json` through run_worker); the tests
then check its result independently: the merged checkpoint loads with plain transformers and computes what base +
adapter computes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from eval_support import tiny_quantized
from finetune_flows.config.schema import load_config
from finetune_flows.config.plan import Plan
from finetune_flows.errors import UserInputError
from finetune_flows.export.merge import RECORD, MergedModel, compare_logits
from finetune_flows.runtime.launcher import python_module, run_worker, write_job

PLAN = Plan(device="cpu", nproc=1, precision="fp32", compute_dtype="float32", train_attn="sdpa",
            eval_attn="sdpa")
PROMPTS = ["Ticket: I was charged twice for my subscription.", "Ticket: the app crashes when I log in.",
           "Ticket: how do I change my delivery address?", "Ticket: my password reset email never arrives."]


@pytest.fixture(scope="module")
def base(shared_cache):
    return tiny_quantized(shared_cache / "export", "float32")


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    """A LoRA adapter on the 4-bit base whose B matrices are not zero, so it changes every logit."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("adapter")
    model = AutoModelForCausalLM.from_pretrained(base.path, device_map={"": "cpu"}, dtype=torch.float32)
    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                            init_lora_weights=False))
    peft.save_pretrained(out)
    AutoTokenizer.from_pretrained(base.path).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data")
    (path / "eval_prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p, "reference": " billing/high"})
                                                       for p in PROMPTS))
    return path


def export(base, adapter, data, out: Path, **settings) -> dict:
    cfg = load_config(None, ["model.source=generated:tiny-llama", *(f"export.{k}={v}" for k, v in settings.items())])
    job = write_job(out.parent / f"{out.name}.work", "export", config=cfg.model_dump(mode="json"),
                    plan=PLAN.model_dump(), base=str(base.path), adapter=str(adapter), data=str(data), out=str(out),
                    fingerprint=out.name, required=True)
    return run_worker("export", python_module("finetune_flows.export.merge", job), {}, job.parent)


def reference_logits(base, adapter, prompts):
    """base + adapter as training computed it: the 4-bit layers multiply by their dequantized weights."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base.path, device_map={"": "cpu"}, dtype=torch.float32), adapter)
    model.train()  # in eval mode bnb's CPU kernel rounds to bf16 (see finetune_flows/export/merge.py); no dropout here
    return logits_of(model, AutoTokenizer.from_pretrained(adapter), prompts)


def logits_of(model, tokenizer, prompts):
    import torch

    with torch.no_grad():
        return [model(input_ids=tokenizer(p, return_tensors="pt").input_ids).logits[0].float() for p in prompts]


def test_merged_logits_equal_base_plus_adapter(base, adapter, data, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = MergedModel.model_validate(export(base, adapter, data, tmp_path / "fp32", dtype="float32"))
    assert record.logit_error < 1e-4 and record.top1_agreement == 1.0 and record.check_prompts == len(PROMPTS)
    log = (tmp_path / "fp32.work" / "export.log").read_text()
    assert "merged" in log and "offloaded modules" not in log  # a warning on every merge, of memory it never needs
    merged = AutoModelForCausalLM.from_pretrained(record.path, dtype=torch.float32).eval()
    prompts = [p + " billing/high" for p in PROMPTS]
    reference = reference_logits(base, adapter, prompts)
    ours = logits_of(merged, AutoTokenizer.from_pretrained(record.path), prompts)
    for a, b in zip(reference, ours):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    error, _, _ = compare_logits(reference, ours)
    assert error < 1e-4
    # The adapter matters: without it the logits are far away, so the comparison above can fail.
    without = logits_of(AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32).train(),
                        AutoTokenizer.from_pretrained(record.path), prompts)
    assert compare_logits(reference, without)[0] > 100 * error


def test_bf16_checkpoint_reloads_with_plain_from_pretrained(base, adapter, data, tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = MergedModel.model_validate(export(base, adapter, data, tmp_path / "bf16"))
    path = record.path
    assert record.dtype == "bfloat16" and record.logit_error <= load_config().export.max_logit_error
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and not (path / "adapter_config.json").exists()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
    assert not [k for k in keys if "lora" in k or "base_layer" in k or "absmax" in k or "quant" in k]
    model = AutoModelForCausalLM.from_pretrained(path)  # no peft, no bitsandbytes, no dtype argument
    assert not any(type(m).__module__.startswith(("peft", "bitsandbytes")) for m in model.modules())
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = model.generate(**tokenizer(PROMPTS[0], return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > len(tokenizer(PROMPTS[0]).input_ids)
    assert (path / RECORD).is_file() and not list(path.parent.glob(".bf16*"))


def test_a_merge_outside_the_tolerance_is_refused_and_nothing_is_kept(base, adapter, data, tmp_path):
    with pytest.raises(UserInputError, match="more than export.max_logit_error"):  # not retried: it would fail again
        export(base, adapter, data, tmp_path / "strict", max_logit_error=1e-9)  # bf16 rounding alone exceeds it
    assert not (tmp_path / "strict").exists() and not list(tmp_path.glob(".strict*"))


def test_text_data_is_checked_on_its_held_out_rows(base, adapter, tmp_path):
    """Text data has no prompts (eval_prompts.jsonl is empty): the merge is checked on the held-out rows' tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    data = tmp_path / "text-data"
    data.mkdir()
    (data / "eval_prompts.jsonl").write_text("")
    ids = [AutoTokenizer.from_pretrained(adapter)(p).input_ids for p in PROMPTS]
    pq.write_table(pa.table({"input_ids": ids, "labels": ids}), data / "eval.parquet")
    record = MergedModel.model_validate(export(base, adapter, data, tmp_path / "text", dtype="float32",
                                               check_prompts=3))
    assert record.logit_error < 1e-4 and record.top1_agreement == 1.0
    assert (record.check_prompts, record.check_tokens) == (3, sum(map(len, ids[:3])))


def test_a_runs_copy_of_the_checkpoint_shares_only_read_only_weights(tmp_path):
    """transformers' save_pretrained rewrites a config or tokenizer file in place: were those hard links, editing one
    run's merged/ would change every other run's and the cache's. Weights stay links (an 8B checkpoint is 16 GB),
    read-only."""
    from finetune_flows.export.merge import link_tree

    cached = tmp_path / "cache-entry"
    cached.mkdir()
    (cached / "model.safetensors").write_bytes(b"weights")
    (cached / "generation_config.json").write_text('{"do_sample": false}')
    (cached / RECORD).write_text("{}")
    link_tree(cached, tmp_path / "run-a")
    link_tree(cached, tmp_path / "run-b")
    (tmp_path / "run-a" / "generation_config.json").write_text('{"do_sample": true}')
    untouched = (cached / "generation_config.json").read_text()
    assert untouched == (tmp_path / "run-b" / "generation_config.json").read_text() == '{"do_sample": false}'
    weights = tmp_path / "run-b" / "model.safetensors"
    assert weights.samefile(cached / "model.safetensors") and weights.stat().st_mode & 0o222 == 0
    assert not (tmp_path / "run-a" / RECORD).exists()


class Placed(BaseModel):
    path: Path


def test_linking_the_weights_into_runs_does_not_make_the_next_reuse_hash_them_again(tmp_path, monkeypatch):
    """A hard link and a chmod set the weights' ctime, which the store's record of verified files holds: every run
    that placed the merged checkpoint made the next reuse of its entry re-hash the weights (16 GB for an 8B model).
    A write into the weights is still found."""
    import finetune_flows.store.entries as entries
    from finetune_flows.export.merge import link_tree

    entry = entries.Entry(tmp_path / "cache", "merged", "k")

    def produce() -> Placed:
        (entry.path / "model.safetensors").write_bytes(b"weights")
        (entry.path / "config.json").write_text("{}")
        return Placed(path=entry.path)

    entries.reuse_or_produce(entry, Placed, produce, outputs=["."])
    reads: list[str] = []
    real = entries.file_digest
    monkeypatch.setattr(entries, "file_digest", lambda p: reads.append(p.name) or real(p))
    for run in ("run-a", "run-b"):
        link_tree(entry.path, tmp_path / run)
        assert entry.problem() is None and reads == []
    weights = entry.path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    weights.chmod(0o644)
    weights.write_bytes(b"WEIGHTS")
    os.utime(weights, ns=(mtime, mtime))
    assert entry.problem() == "model.safetensors does not match its sha256 in the manifest"


def card_inputs(tmp_path: Path) -> tuple:
    """What render_card takes besides the config: a merged model, its base, data and environment (records only)."""
    from finetune_flows.data.dataset import PreparedDataset
    from finetune_flows.models.quantize import QuantizedModel
    from finetune_flows.runtime.environment import EnvironmentReport

    merged = MergedModel(path=tmp_path / "merged", fingerprint="f" * 24, dtype="bfloat16", parameters=139_584,
                         size_mb=0.3, logit_error=0.007, top1_agreement=1.0, check_prompts=8, check_tokens=582,
                         device="cpu", seconds=1.0)
    base = QuantizedModel(path=tmp_path / "quantized", fingerprint="b" * 24, load_in_4bit=True,
                          compute_dtype="float32", memory_footprint_mb=0.3, linear4bit_layers=14, quantize_seconds=1.0)
    data = PreparedDataset(path=tmp_path / "data", fingerprint="d" * 24, format="instruction", train_rows=108,
                           eval_rows=12, train_tokens=8157, truncated=0, dropped=0)
    env = EnvironmentReport(python="3.11", platform="linux", torch="2.13", cuda_available=False, cuda_version=None,
                            driver_version=None, gpus=[], versions={}, attention={}, bitsandbytes_4bit="available",
                            hub_reachable=False)
    return merged, base, data, env


def test_the_cards_front_matter_names_a_local_base_whose_path_yaml_would_cut(tmp_path):
    """`base_model: /models/exp #3` was written unquoted: YAML read `/models/exp` (the rest a comment), and a path
    with ": " made the whole front matter unreadable, so `flows/evaluate.py --merged` lost the adapter it names."""
    import yaml

    from finetune_flows.export.model_card import render_card

    merged, base, data, env = card_inputs(tmp_path)
    adapter = tmp_path / "run" / "adapter"
    for source in ("/models/exp #3", "/models/v1: rerun", "generated:tiny-llama"):
        cfg = load_config(None, [f"model.source={json.dumps(source)}"])  # quoted: --set parses YAML
        card = render_card("run", merged, cfg, base, data, env, [], adapter, tmp_path / "run" / "config.resolved.yaml")
        front = yaml.safe_load(card.split("---\n", 2)[1])
        assert front["base_model"] == source and front["finetune_flows"]["adapter"] == str(adapter), card[:300]
    assert "base_model: generated:tiny-llama\n" in card  # quoted only where YAML needs it


def test_the_cards_configuration_names_the_cache_the_run_used(tmp_path, monkeypatch):
    """With FINETUNE_FLOWS_CACHE set, the card's configuration named the config's run.cache_dir, which the run never
    used; it now says what config.resolved.yaml says."""
    import yaml

    from finetune_flows.export.model_card import render_card

    monkeypatch.setenv("FINETUNE_FLOWS_CACHE", str(tmp_path / "used"))
    cfg = load_config(None, [f"run.cache_dir={tmp_path / 'set'}"])
    merged, base, data, env = card_inputs(tmp_path)
    card = render_card("run", merged, cfg, base, data, env, [], tmp_path / "adapter", tmp_path / "config.resolved.yaml")
    configuration = yaml.safe_load(card.split("## Configuration\n\n```yaml\n")[1].split("```")[0])
    assert configuration["run"]["cache_dir"] == str(tmp_path / "used")


def test_the_export_command_refuses_to_be_told_not_to_merge_before_anything_loads(tmp_path, capsys):
    """`flows/export.py --adapter A --set export.merge=false` merged all the same, without a word. A run's own
    config with `export.merge: false` (merge later, with this command) is no reason to refuse."""
    from safetensors.numpy import save_file

    from flows.export import main

    runs = tmp_path / "runs"
    adapter = runs / "tiny-20261130-013000-abc123" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "tokenizer_config.json").write_text("{}")
    save_file({"w": __import__("numpy").zeros(1, dtype="float32")}, str(adapter / "adapter_model.safetensors"))
    trained = load_config(None, ["model.source=generated:tiny-llama", "export.merge=false",
                                 f"run.output_dir={runs}", f"run.cache_dir={tmp_path / 'cache'}"])
    (adapter.parent / "config.resolved.yaml").write_text(trained.to_yaml())
    for no in ("false", "no", "0"):
        assert main(["--adapter", str(adapter), "--set", f"export.merge={no}"]) == 2
        assert capsys.readouterr().err == ("error: --set export.merge=false: flows/export.py always merges "
                                           "(export.merge turns off only the fine-tune flow's merge at its end); "
                                           "leave it out\n")
    assert sorted(p.name for p in runs.iterdir()) == [adapter.parent.name] and not (tmp_path / "cache").exists()
    from flows.export import check_merge_not_turned_off

    check_merge_not_turned_off(trained, [])  # the run's own `export.merge: false`
    check_merge_not_turned_off(trained, ["export.dtype=float16"])


def test_an_export_cards_commands_make_this_checkpoint_again(tmp_path):
    """The card of `flows/export.py --adapter A --set export.dtype=float16` (on a run trained with export.merge=false)
    said to reproduce it with `flows/export.py --adapter A` (a bfloat16 checkpoint) and that the fine-tune command
    would "train, evaluate and merge again" (it does not merge)."""
    from finetune_flows.export.model_card import render_card

    merged, base, data, env = card_inputs(tmp_path)
    adapter, config_file = tmp_path / "run" / "adapter", tmp_path / "run" / "config.resolved.yaml"
    trained = load_config(None, ["export.merge=false", "tracking.report_to=[tensorboard]"])
    export = load_config(None, ["export.merge=false", "export.dtype=float16", "data.source=/data/a b.jsonl",
                                "data.format=instruction", "eval.metric=contains", "run.name=elsewhere"])
    card = render_card("run", merged, export, base, data, env, [], adapter, config_file, trained)
    assert (f"python flows/finetune.py --config {config_file}   # train, evaluate again (it does not merge: "
            "export.merge is off)\n") in card
    assert (f"python flows/export.py --adapter {adapter} --set 'data.source=/data/a b.jsonl' --set "
            "data.format=instruction --set eval.metric=contains --set export.dtype=float16   # merge this adapter "
            "again\n") in card
    card = render_card("run", merged, trained, base, data, env, [], adapter, config_file)  # the run's own config
    assert f"python flows/export.py --adapter {adapter}   # merge this adapter again\n" in card


def test_the_cards_commands_quote_paths_with_spaces(tmp_path):
    """`finetune.py --config` and `evaluate.py --merged` were written unquoted: a run under a directory with a space
    gave commands that split the path in two (the export command beside them was quoted)."""
    import shlex

    from finetune_flows.export.model_card import render_card

    root = tmp_path / "my runs"
    merged, base, data, env = card_inputs(root)
    adapter, config_file = root / "run" / "adapter", root / "run" / "config.resolved.yaml"
    card = render_card("run", merged, load_config(None, []), base, data, env, [], adapter, config_file)
    commands = card.split("## Reproduce\n\n```bash\n")[1].split("```")[0].splitlines()
    assert [shlex.split(c.split("   #")[0]) for c in commands] == [
        ["python", "flows/finetune.py", "--config", str(config_file)],
        ["python", "flows/export.py", "--adapter", str(adapter)],
        ["python", "flows/evaluate.py", "--merged", str(merged.path)]]


def test_an_export_that_only_dropped_the_trainings_tracking_is_not_carded_as_another_config(tmp_path):
    """flows/export.py logs to no tracker (without_tracking): the card of a plain export of a run that logged to
    MLflow said "The export itself ran with another config" and listed sections equal to the training's."""
    from finetune_flows.config.preflight import without_tracking
    from finetune_flows.export.model_card import render_card, training_config_of

    merged, base, data, env = card_inputs(tmp_path)
    config_file = tmp_path / "run" / "config.resolved.yaml"
    config_file.parent.mkdir()
    config_file.write_text(load_config(None, ["tracking.mlflow_uri=http://127.0.0.1:5000"]).to_yaml())
    cfg = without_tracking(load_config(config_file))
    card = render_card("run", merged, cfg, base, data, env, [], tmp_path / "run" / "adapter", config_file,
                       training_config_of(config_file, cfg))
    assert "another config" not in card and "mlflow_uri: http://127.0.0.1:5000" in card  # the training's, in full
