"""Numbers a user can trust: held out means held out, metrics say what they compute, BOS/EOS as the tokenizer
defines them, and one seed gives one adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conftest import tiny_overrides
from finetune_flows.config.schema import load_config
from finetune_flows.data.dataset import (
    IGNORE_INDEX, build_dataset, fold, prompt_and_reference, prompt_text, tokenize_example,
)
from finetune_flows.data.demo import ticket_triage
from finetune_flows.errors import DataError
from finetune_flows.evaluation.metrics import explain, rates, score_answer
from finetune_flows.models.sources import CHATML, build_generated_tokenizer
from finetune_flows.reporting.summary import render_summary

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}]


# ---------------------------------------------------------------- held out means held out


def test_the_demo_generator_never_repeats_a_prompt_so_its_eval_split_has_zero_overlap():
    examples = ticket_triage(1000, seed=42)  # configs/demo.yaml: builtin_examples 1000, data.seed 42
    folded = [fold(ex["system"] + ex["prompt"], digits=True) for ex in examples]
    assert len(set(folded)) == len(folded)  # distinct even with case, digits and whitespace folded: any split is clean
    with pytest.raises(Exception, match="distinct tickets"):
        ticket_triage(5000)


def test_demo_dataset_reports_nothing_removed(tmp_path, shared_cache):
    from finetune_flows.models.sources import materialize_tokenizer

    cfg = load_config(Path(__file__).parent.parent / "configs" / "demo.yaml", [f"run.cache_dir={tmp_path}"])
    result = build_dataset(cfg, materialize_tokenizer("generated:tiny-llama", shared_cache), tmp_path / "d")
    assert (result.eval_removed_exact, result.eval_removed_normalized, result.eval_rows) == (0, 0, 100)


def held_out_build(tmp_path, shared_cache, train: list[dict], held: list[dict], *overrides: str):
    from finetune_flows.models.sources import materialize_tokenizer

    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in train))
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in held))
    cfg = load_config(None, [f"data.source={tmp_path / 'train.jsonl'}", f"data.eval_source={tmp_path / 'eval.jsonl'}",
                             *overrides])
    return build_dataset(cfg, materialize_tokenizer("generated:tiny-llama", shared_cache), tmp_path / "d")


def test_held_out_rows_copying_training_prompts_are_removed_and_counted(tmp_path, shared_cache):
    train = [{"prompt": f"Order {w} is late", "response": "shipping"} for w in ("alpha", "beta", "gamma", "delta")]
    train += [{"prompt": "Invoice 1234 is wrong", "response": "billing"}]
    held = [{"prompt": "Order alpha is late", "response": "shipping"},  # exact copy
            {"prompt": "invoice  1234 IS wrong", "response": "billing"},  # same once case and spaces are folded
            {"prompt": "Invoice 98 is wrong", "response": "billing"},  # another number: another prompt
            {"prompt": "My password expired", "response": "account"}]  # really held out
    result = held_out_build(tmp_path, shared_cache, train, held)
    assert (result.eval_removed_exact, result.eval_removed_normalized, result.eval_rows) == (1, 1, 2)
    assert result.removed_note() == ("2 held-out row(s) removed as copies of training prompts (1 exact, 1 after "
                                     "folding case and whitespace)")
    lines = (tmp_path / "d" / "eval_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines]
    assert len(prompts) == 2 and "Invoice 98 is wrong" in prompts[0] and "My password expired" in prompts[1]

    folded = held_out_build(tmp_path, shared_cache, train, held, "data.held_out_fold_digits=true")
    assert (folded.eval_removed_exact, folded.eval_removed_normalized, folded.eval_rows) == (1, 2, 1)
    assert folded.removed_note().endswith("(1 exact, 2 after folding case, digits and whitespace)")


def test_prompts_that_differ_only_in_numbers_are_not_copies(tmp_path, shared_cache):
    """An arithmetic task: every prompt has the same words, other numbers. None is a copy of another."""
    rows = [{"prompt": f"What is {a} + {b}?", "response": str(a + b)} for a in range(11, 17) for b in range(3, 8)]
    result = held_out_build(tmp_path, shared_cache, rows[:20], rows[20:])
    assert (result.eval_removed_exact, result.eval_removed_normalized, result.eval_rows) == (0, 0, 10)
    with pytest.raises(DataError, match=r"eval.jsonl: every held-out .* after folding case, digits and whitespace, "
                                        r"data.held_out_fold_digits=true\): .*differ from the training ones"):
        held_out_build(tmp_path, shared_cache, rows[:20], rows[20:], "data.held_out_fold_digits=true")


def test_prompt_text_is_everything_before_the_last_answer():
    assert prompt_text(CHAT) == "system: Be brief.\nuser: hi"
    assert fold("Order  123 IS\tlate ") == "order 123 is late"
    assert fold("Order  123 IS\tlate ", digits=True) == "order 0 is late"


# ---------------------------------------------------------------- metrics


def test_exact_match_is_case_sensitive_on_stripped_text_and_contains_is_reported_beside_it():
    assert score_answer("  billing/high\n", "billing/high", "exact_match")
    assert not score_answer("Billing/high", "billing/high", "exact_match")
    assert score_answer("The team is billing/high.", "billing/high", "contains")
    assert not score_answer("The team is Billing/High.", "billing/high", "contains")
    assert not score_answer("anything", " ", "contains")  # '' is in every answer
    assert rates(["billing/high", "it is billing/high", "no idea", "shipping/low"], ["billing/high"] * 4) == {
        "exact_match": 0.25, "contains": 0.5}


def test_the_base_score_is_explained_as_format_versus_ability():
    text = explain({"exact_match": 0.0, "contains": 0.3}, {"exact_match": 0.9, "contains": 0.92})
    assert "Base model: exact match 0.00, contains 0.30" in text
    assert "In 30% of the prompts the base model names the right answer" in text and "format, not ability" in text
    assert "In 70% the right answer does not appear in its output at all: that part is ability" in text


# ---------------------------------------------------------------- BOS and EOS as the tokenizer defines them


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The generated tokenizer three ways: ChatML without BOS, no template but a default BOS (like a base model's
    Llama/Gemma tokenizer), and a template that writes the BOS itself."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizers")
    build_generated_tokenizer(root / "chatml")
    chatml = AutoTokenizer.from_pretrained(root / "chatml")
    backend = Tokenizer.from_str(chatml.backend_tokenizer.to_str())
    bos = "<s>"
    backend.add_special_tokens([bos])
    backend.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                special_tokens=[(bos, backend.token_to_id(bos))])
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(root / "bos")
    plain_bos = AutoTokenizer.from_pretrained(root / "bos")
    templated_bos = AutoTokenizer.from_pretrained(root / "bos")
    templated_bos.chat_template = "{{ bos_token }}" + CHATML
    return chatml, plain_bos, templated_bos


def test_template_less_tokenizer_with_a_bos_gets_it_in_every_layout(tokenizers):
    _, tok, _ = tokenizers
    assert tok.chat_template is None and tok("x")["input_ids"][0] == tok.bos_token_id
    for example in (CHAT, "plain text to learn"):
        enc, _ = tokenize_example(tok, example, 128)
        assert enc["input_ids"][0] == tok.bos_token_id and enc["input_ids"].count(tok.bos_token_id) == 1
        assert enc["labels"][0] == IGNORE_INDEX  # BOS is never a target
        assert enc["input_ids"][-1] == enc["labels"][-1] == tok.eos_token_id  # the answer ends with EOS, learned
    prompt = prompt_and_reference(tok, CHAT)["prompt"]  # what evaluation feeds with add_special_tokens=False
    assert tok(prompt, add_special_tokens=False)["input_ids"][0] == tok.bos_token_id


def test_a_template_that_writes_the_bos_gets_exactly_one(tokenizers):
    _, _, tok = tokenizers
    enc, _ = tokenize_example(tok, CHAT, 128)
    assert enc["input_ids"][0] == tok.bos_token_id and enc["input_ids"].count(tok.bos_token_id) == 1
    assert tok.decode(enc["input_ids"][:2]) == "<s><|im_start|>"


def test_a_tokenizer_without_a_default_bos_gets_none(tokenizers):
    chatml, _, _ = tokenizers
    enc, _ = tokenize_example(chatml, CHAT, 128)
    assert chatml.bos_token is None and chatml.decode(enc["input_ids"]).startswith("<|im_start|>system")


@pytest.mark.parametrize("add_bos,add_eos", [(True, None), (False, True)])
def test_a_gguf_models_bos_and_eos_settings_reach_training_rows_and_eval_prompts(tmp_path, add_bos, add_eos):
    """tokenizer.ggml.add_bos_token / add_eos_token of a GGUF (Gemma-3's say add_bos_token = true), which the
    tokenizer transformers builds from the file ignores: the dataset's tokenizer and the converted checkpoint's
    carry them."""
    from conftest import tiny_gguf
    from finetune_flows.models.sources import materialize_model, materialize_tokenizer

    path = tiny_gguf(tmp_path / "tiny.gguf", add_bos=add_bos, add_eos=add_eos)
    example = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "de"}]
    for directory in (materialize_tokenizer(str(path), tmp_path / "cache"),
                      materialize_model(str(path), tmp_path / "cache")):
        tok = AutoTokenizer.from_pretrained(directory)
        ids = tok("ab", add_special_tokens=True)["input_ids"]
        assert (ids[0] == tok.bos_token_id) is add_bos and (ids[-1] == tok.eos_token_id) is bool(add_eos)
        enc, _ = tokenize_example(tok, example, 64)
        prompt = prompt_and_reference(tok, example)["prompt"]
        starts = tok(prompt, add_special_tokens=False)["input_ids"][0]
        assert (enc["input_ids"][0] == tok.bos_token_id) is add_bos and (starts == tok.bos_token_id) is add_bos
        assert enc["input_ids"].count(tok.bos_token_id) == int(add_bos)


# ---------------------------------------------------------------- one seed, one adapter


@pytest.mark.slow
def test_two_cpu_runs_with_one_config_train_the_same_adapter_bytes(prefect_server, tmp_path):
    from flows.finetune import finetune

    overrides = tiny_overrides(tmp_path / "cache", tmp_path / "runs", **{"lora.dropout": 0.1})
    first = finetune(load_config(None, overrides))
    adapter = (first.adapter_path / "adapter_model.safetensors").read_bytes()
    assert first.eval.held_out_removed == 0 and "Base model: exact match" in first.eval.explanation
    assert (f"held out: {first.eval.eval_rows} rows evaluated; 0 held-out row(s) removed as copies of training "
            "prompts (0 exact, 0 after folding case and whitespace)") in render_summary(first)
    assert set(first.eval.rates["adapter"]) == {"exact_match", "contains"}
    shutil.rmtree(Path(first.train.output_dir))  # forget the adapter (and its checkpoints): train from scratch

    second = finetune(load_config(None, overrides))
    assert "train-adapter" not in second.cached_steps
    assert (second.adapter_path / "adapter_model.safetensors").read_bytes() == adapter
    assert "evaluate-adapter" in second.cached_steps  # same adapter bytes, so the same evaluation key
