"""Generation engines (finetune_flows/evaluation/generation.py) and the loss pass on the CPU: the fast engines give the
very greedy tokens of `generate()`, with the adapter on and off, and refuse what they cannot run with a clear
message."""

from __future__ import annotations

import pytest

from eval_support import tiny_quantized
from finetune_flows.models.dequantize import dequantized_copy
from finetune_flows.evaluation.generation import (
    EngineUnavailable, choose_engine, generate_continuous, generate_reference, stop_token_ids,
)
from finetune_flows.evaluation.static_engine import generate_static, length_sorted_batches


@pytest.fixture(scope="module")
def model_and_prompts(shared_cache):
    """The tiny model's fp32 evaluation copy with a random (non-zero) LoRA adapter, and prompts of varied length."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = shared_cache / "generation"
    copy = dequantized_copy(tiny_quantized(cache), cache)
    tokenizer = AutoTokenizer.from_pretrained(copy)
    model = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # at init scale (std 0.02) every prompt gets the same answer; scaled, they differ
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.mul_(4)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()
    prompts = [f"Ticket {i}: " + "the invoice is wrong " * (i % 5) + "order late " * (i % 3) for i in range(24)]
    return model, tokenizer, prompts


def one_by_one(model, tokenizer, prompts, new_tokens, stops):
    """model.generate() on each prompt alone: no padding, nothing shared."""

    out = []
    for p in prompts:
        ids = tokenizer(p, add_special_tokens=False, return_tensors="pt")["input_ids"]
        row = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        out.append(next((row[:i] for i, t in enumerate(row) if t in stops), row))
    return out


@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
def test_engines_give_identical_greedy_tokens(model_and_prompts, adapter):
    model, tokenizer, prompts = model_and_prompts
    (model.base_model.enable_adapter_layers if adapter else model.base_model.disable_adapter_layers)()
    stops, pad = stop_token_ids(model, tokenizer), tokenizer.pad_token_id
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    expected = one_by_one(model, tokenizer, prompts, 10, stops)
    assert len({tuple(t) for t in expected}) > 3  # the prompts lead to different answers: a meaningful check
    runs = {
        "generate": generate_reference(model, tokenizer, prompts, 10, batch_size=8),
        "static": generate_static(model, ids, 10, stops, pad, batch_tokens=160),
        "static-grouped": generate_static(model, ids, 10, stops, pad, batch_tokens=160, grouped_decode=True),
        "continuous": generate_continuous(model, ids, 10, stops, pad, batch_tokens=64, memory_bytes=2**26),
    }
    assert runs["static"].details["batches"] > 2  # several length-sorted batches were really used
    assert runs["static-grouped"].details["decode_attention"] == "finetune_flows_grouped_decode"
    assert runs["static"].details["decode_attention"] != "finetune_flows_grouped_decode"  # its default is for CUDA
    assert runs["static"].details["decode_steps"] > 0 and runs["static"].details["decode_seconds"] > 0
    for name, run in runs.items():
        assert not run.failures, name
        assert run.tokens == expected, name
        assert 0 < run.first_result_seconds <= run.seconds, name


def test_each_prefill_chunk_is_read_at_its_own_width(model_and_prompts, monkeypatch):
    """One batch of all prompts (left-padded to the longest), prefilled four rows at a time: each chunk's forward
    pass spans only its own prompts' longest, not the batch's, and the answers stay the engine-equivalent ones."""
    from finetune_flows.evaluation import static_engine

    model, tokenizer, prompts = model_and_prompts
    model.base_model.enable_adapter_layers()
    stops, pad = stop_token_ids(model, tokenizer), tokenizer.pad_token_id
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    longest = max(map(len, ids))
    monkeypatch.setitem(static_engine.PREFILL_TOKENS, False, 4 * longest)  # rows per chunk: 4
    widths = []
    hook = model.get_base_model().register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape), with_kwargs=True)
    try:
        run = generate_static(model, ids, 6, stops, pad, batch_tokens=10**6)
    finally:
        hook.remove()
    assert run.details["batches"] == 1
    chunks = [shape for shape in widths if shape[1] > 1][: -(-len(ids) // 4)]  # the prefill's passes, in order
    by_length = sorted(map(len, ids), reverse=True)
    assert [w for _, w in chunks] == [by_length[i] for i in range(0, len(ids), 4)]  # each chunk: its own longest
    assert chunks[-1][1] < longest
    assert run.tokens == generate_static(model, ids, 6, stops, pad, batch_tokens=160).tokens


def test_the_adapter_changes_the_answers(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    stops, pad = stop_token_ids(model, tokenizer), tokenizer.pad_token_id
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    model.base_model.disable_adapter_layers()
    base = generate_static(model, ids, 6, stops, pad, batch_tokens=4096).tokens
    model.base_model.enable_adapter_layers()
    adapted = generate_static(model, ids, 6, stops, pad, batch_tokens=4096).tokens
    assert base != adapted


def test_answer_loss_equals_the_padded_reference(model_and_prompts):
    import torch

    from finetune_flows.evaluation.worker import answer_loss, padded_loss, shared_answers

    model, tokenizer, prompts = model_and_prompts
    model.base_model.enable_adapter_layers()
    rows = []
    for i, p in enumerate(prompts):
        prompt = tokenizer(p, add_special_tokens=False)["input_ids"]
        answer = tokenizer(f" team{i % 4}/high", add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    pad = tokenizer.pad_token_id
    reference = padded_loss(model, rows, 5, pad, torch.device("cpu"))
    total, count = answer_loss(model, rows, 200, pad, torch.device("cpu"))
    assert total / count == pytest.approx(reference, rel=1e-5)
    # the static engine scores the same answers from the prompts' cache while it generates
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[:-3]]  # 3 rows left over
    shared, rest = shared_answers(rows, prompt_ids)
    assert sum(a is not None for a in shared) == len(prompt_ids) and len(rest) == 3
    run = generate_static(model, prompt_ids, 4, stop_token_ids(model, tokenizer), pad, 160, answers=shared)
    shared_total, shared_count = run.details["loss"]
    rest_total, rest_count = answer_loss(model, rest, 200, pad, torch.device("cpu"))
    assert (shared_total + rest_total) / (shared_count + rest_count) == pytest.approx(reference, rel=1e-5)
    assert run.tokens == generate_static(model, prompt_ids, 4, stop_token_ids(model, tokenizer), pad, 160).tokens


def test_answers_stop_at_the_templates_end_of_turn_when_it_is_not_eos(model_and_prompts, monkeypatch):
    """A Qwen2.5 base model's EOS is `<|endoftext|>` while its ChatML template ends each turn with `<|im_end|>`, the
    token training ends every answer with: generation must stop there, or a right answer goes on into the next turn
    (`billing/low` + `\\nbilling/low\\n` once `<|im_end|>` is skipped in decoding) and never matches exactly."""
    import copy

    model, tokenizer, _ = model_and_prompts
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(model, tokenizer) == [end]  # the generated model: EOS is the end of turn
    base_like = copy.deepcopy(tokenizer)
    base_like.eos_token = "<|endoftext|>"
    monkeypatch.setattr(model.generation_config, "eos_token_id", base_like.eos_token_id)
    assert stop_token_ids(model, base_like) == sorted({base_like.eos_token_id, end})
    base_like.chat_template = None  # no template: the plain layout ends answers with EOS alone
    assert stop_token_ids(model, base_like) == [base_like.eos_token_id]


def test_a_sliding_window_models_answer_loss_covers_every_row(model_and_prompts):
    """The static engine scores answers from the prompt cache only where every layer caches the whole sequence. A
    model with sliding-window layers (Mistral-7B-v0.1, Phi-3, Gemma) got them handed anyway and scored none: the
    evaluation's loss left those rows out (0.0, perplexity 1.0, when every row had a prompt)."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from finetune_flows.evaluation.static_engine import plain_cache
    from finetune_flows.evaluation.worker import answer_loss, loss_split, padded_loss

    llama, tokenizer, prompts = model_and_prompts
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4096, pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa")).eval()
    assert plain_cache(llama) and not plain_cache(model)
    rows, prompt_ids = [], []
    for i, p in enumerate(prompts):
        prompt_ids.append(tokenizer(p, add_special_tokens=False)["input_ids"])
        answer = tokenizer(f" team{i % 4}/high", add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": prompt_ids[-1] + answer, "labels": [-100] * len(prompt_ids[-1]) + answer})
    pad, cpu = tokenizer.pad_token_id, torch.device("cpu")
    shared, rest = loss_split("static", model, rows, prompt_ids)
    run = generate_static(model, prompt_ids, 4, stop_token_ids(model, tokenizer), pad, 4096, answers=shared)
    total, count = answer_loss(model, rest, 4096, pad, cpu)
    loss = (total + run.details["loss"][0]) / max(count + run.details["loss"][1], 1)  # as the worker sums them
    assert loss == pytest.approx(padded_loss(model, rows, 5, pad, cpu), rel=1e-5)
    answers, _ = loss_split("static", llama, rows, prompt_ids)
    with pytest.raises(ValueError, match="plain_cache"):  # answers it cannot score are refused, not dropped
        generate_static(model, prompt_ids, 4, stop_token_ids(model, tokenizer), pad, 4096, answers=answers)


def test_length_sorted_batches_fit_the_budget():
    lengths = [5, 50, 7, 30, 30, 2]
    batches = length_sorted_batches(lengths, 10, 130)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert [lengths[b[0]] for b in batches] == sorted((lengths[b[0]] for b in batches), reverse=True)
    assert all(len(b) * (lengths[b[0]] + 10) <= 130 or len(b) == 1 for b in batches)
    assert length_sorted_batches([500], 10, 64) == [[0]]  # a prompt longer than the budget still runs alone


def test_engines_that_cannot_run_here_are_refused_clearly():
    with pytest.raises(EngineUnavailable, match="continuous cannot use attention backend flex_attention"):
        choose_engine("continuous", "flex_attention")
    with pytest.raises(EngineUnavailable, match="spread over 2 GPUs"):
        choose_engine("continuous", "flash_attention_2", devices=2)
    with pytest.raises(EngineUnavailable, match="unknown engine"):
        choose_engine("vllm", "sdpa")
    assert choose_engine("auto", "sdpa") == "static"
    assert choose_engine("auto", "flash_attention_3", devices=2) == "static"
    assert choose_engine("generate", "flex_attention") == "generate"


def test_cuda_graphs_are_refused_without_a_gpu(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    with pytest.raises(EngineUnavailable, match="CUDA graphs need a CUDA device"):
        generate_static(model, [[1, 2, 3]], 2, [tokenizer.eos_token_id], 0, 64, cuda_graphs=True)


@pytest.mark.parametrize("query_len", [1, 3])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_grouped_attention_equals_sdpa(query_len, mask_kind):
    """The grouped decode attention against transformers' sdpa (which copies the KV heads out) on a GQA shape:
    4 KV heads shared by 16 query heads, left padding and unused static-cache columns masked."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from finetune_flows.evaluation.static_engine import _grouped_attention

    torch.manual_seed(0)
    b, heads, kv_heads, dim, length = 3, 16, 4, 32, 40
    query = torch.randn(b, heads, query_len, dim)
    key, value = torch.randn(b, kv_heads, length, dim), torch.randn(b, kv_heads, length, dim)
    keep = torch.ones(b, 1, query_len, length, dtype=torch.bool)
    keep[0, ..., :7] = False  # left padding of row 0
    for i in range(query_len):  # the new positions fill columns 30 - query_len .. 29; each sees those before it
        keep[:, :, i, 30 - query_len + i + 1:] = False
    mask = keep if mask_kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, heads // kv_heads
    got, _ = _grouped_attention(module, query, key, value, mask, scaling=dim ** -0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    assert got.shape == want.shape == (b, query_len, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_adapter_runs_in_the_evaluation_copys_dtype_not_pefts_fp32(shared_cache, tmp_path):
    """PEFT loads LoRA weights in fp32; on a bf16 copy every adapted layer would then run its adapter in fp32 (on an
    H200 that made the adapter's prefill 1.8x the base's). The fast engines get the adapter in the copy's dtype, the
    reference engine keeps PEFT's fp32 (bf16 compute here on the CPU, as on a GPU)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune_flows.config.schema import load_config
    from finetune_flows.config.plan import Plan
    from finetune_flows.evaluation.worker import _load_with_adapter

    cache = shared_cache / "generation-bf16"
    base = tiny_quantized(cache, "bfloat16")
    plain = AutoModelForCausalLM.from_pretrained(dequantized_copy(base, cache), dtype=torch.bfloat16)
    get_peft_model(plain, LoraConfig(r=4, target_modules="all-linear")).save_pretrained(tmp_path / "adapter")
    cfg = load_config(None, [f"run.cache_dir={cache}"])
    plan = Plan(device="cpu", nproc=1, precision="bf16", compute_dtype="bfloat16", train_attn="sdpa",
                eval_attn="sdpa", eval_dtype="bfloat16")
    for engine, expected in (("static", torch.bfloat16), ("generate", torch.float32)):
        model = _load_with_adapter(cfg, base, tmp_path / "adapter", plan, torch.device("cpu"), engine)
        assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {expected}, engine
