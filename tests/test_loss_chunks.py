"""train.loss_chunk_tokens (finetune_flows/training/loss_chunks.py): Liger's fused linear cross-entropy in chunks of
at least the asked tokens. Liger's Triton kernels cannot run on this CPU (and liger-kernel is a GPU extra), so a
stand-in `liger_kernel.transformers.functional` with Liger's signature and chunking (liger-kernel 0.8.5,
ops/fused_linear_cross_entropy.py: inc_factor, chunk_size, num_chunks) computes the chunked loss in torch; the GPU
bench measures the real one (`--variant <label>:train.loss_chunk_tokens=1024`). `auto` (the default): the planner's
choice, tested here on the benchmark's shapes and budgets."""
from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

from finetune_flows.config.plan import loss_chunk_setting, takes_chunk_sizes
from finetune_flows.config.schema import load_config
from finetune_flows.errors import UserInputError
from finetune_flows.models.sources import ARCHS
from finetune_flows.training.loss_chunks import chunk_mem_const, liger_chunks
from finetune_flows.training.planner import (AUTO_LOSS_CHUNK_TOKENS, ModelShape, largest_chunk, memory_parts,
                                             plan_training)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def liger_chunk_size(rows: int, hidden: int, vocab: int, chunk_mem_const: int = 1) -> int:
    """Liger 0.8.5's chunk size for a (rows x hidden) input and a vocab-row lm_head."""
    inc_factor = _cdiv(vocab, chunk_mem_const * hidden)
    return min(1 << (_cdiv(rows, inc_factor) - 1).bit_length(), rows)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-8b"])
def test_the_chunks_hold_at_least_the_asked_tokens_and_at_most_what_the_planner_counts(name):
    shape = ModelShape.from_config(ARCHS[name])
    for tokens in (256, 1000, 1024, 4096):
        for rows in range(1, 40_000, 37):
            const = chunk_mem_const(rows, shape.hidden, shape.vocab, tokens)
            chunk = liger_chunk_size(rows, shape.hidden, shape.vocab, const)
            assert chunk >= min(tokens, rows), (tokens, rows)
            if const > 1:  # where it raised Liger's own (whose chunks the planner's per-token logits cover)
                assert chunk <= largest_chunk(tokens), (tokens, rows, chunk)


def test_liger_s_own_chunks_are_small_for_a_small_hidden_size():
    """What the option is for: Qwen3-0.6B's micro-batches of 3,366 and 10,098 tokens in chunks of 32 and 128 tokens
    (106 and 79 chunks, each reading the whole lm_head weight twice); with 1,024 asked, 2,048 and 2,048."""
    shape = ModelShape.from_config(ARCHS["qwen3-0.6b"])
    assert [liger_chunk_size(rows, shape.hidden, shape.vocab) for rows in (3366, 10098)] == [32, 128]
    asked = [liger_chunk_size(rows, shape.hidden, shape.vocab, chunk_mem_const(rows, shape.hidden, shape.vocab, 1024))
             for rows in (3366, 10098)]
    assert asked == [2048, 2048]


@pytest.fixture
def stand_in_liger(monkeypatch):
    """A `liger_kernel.transformers.functional` whose fused loss chunks the rows as Liger 0.8.5 does, computes each
    chunk's cross-entropy in torch, and records the chunk sizes it used."""
    calls: list[list[int]] = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                         lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                         return_z_loss=False, accum_dtype=None, use_token_scaling=False,
                                         return_token_accuracy=False, return_predicted_tokens=False,
                                         chunk_mem_const: int = 1):
        rows = input.shape[0]
        size = liger_chunk_size(rows, input.shape[1], weight.shape[0], chunk_mem_const)
        sizes, total = [], input.new_zeros((), dtype=torch.float32)
        for start in range(0, rows, size):
            logits = input[start:start + size] @ weight.t()
            total = total + torch.nn.functional.cross_entropy(logits.float(), target[start:start + size],
                                                              ignore_index=ignore_index, reduction="sum")
            sizes.append(logits.shape[0])
        calls.append(sizes)
        return total / (target != ignore_index).sum() if reduction == "mean" else total

    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    transformers_pkg = types.ModuleType("liger_kernel.transformers")
    transformers_pkg.functional = functional
    package = types.ModuleType("liger_kernel")
    package.transformers = transformers_pkg
    for name, module in (("liger_kernel", package), ("liger_kernel.transformers", transformers_pkg),
                         ("liger_kernel.transformers.functional", functional)):
        monkeypatch.setitem(sys.modules, name, module)
    return functional, calls


def test_liger_chunks_makes_each_call_use_the_larger_chunks_with_the_same_loss(stand_in_liger):
    functional, calls = stand_in_liger
    torch.manual_seed(0)
    hidden, vocab, rows = 64, 4096, 1000  # Liger's own chunks: 1000 / (4096 / 64) -> 16 tokens
    x, w = torch.randn(rows, hidden), torch.randn(vocab, hidden) / 8
    target = torch.randint(0, vocab, (rows,))
    target[::7] = -100
    original = functional.liger_fused_linear_cross_entropy
    before = original(x, w, target)
    liger_chunks(256)
    liger_chunks(256)  # a second call wraps Liger's function, not the wrapper
    after = functional.liger_fused_linear_cross_entropy(x, w, target, reduction="mean")
    assert len(calls[0]) == 63 and max(calls[0]) == 16
    assert min(calls[1][:-1]) >= 256 and sum(calls[1]) == rows and len(calls[1]) <= 4
    torch.testing.assert_close(after, before)
    # Liger's causal-LM loss keeps only the keywords this signature names: chunk_mem_const stays one of them
    assert "chunk_mem_const" in inspect.signature(functional.liger_fused_linear_cross_entropy).parameters
    assert functional.liger_fused_linear_cross_entropy.__wrapped__ is original


def test_liger_chunks_refuses_a_liger_without_chunk_mem_const(stand_in_liger):
    functional, _ = stand_in_liger
    functional.liger_fused_linear_cross_entropy = lambda input, weight, target, reduction="mean": None
    with pytest.raises(RuntimeError, match="liger-kernel >= 0.8.5"):
        liger_chunks(1024)


def test_the_planner_counts_the_larger_chunk_s_logits_only_with_the_fused_loss():
    shape = ModelShape.from_config(ARCHS["qwen3-0.6b"])
    common = dict(checkpointing=False, four_bit=False, lora_r=16, lora_targets="all-linear", upcast=False)
    parts = memory_parts(shape, 3366, fused_ce=True, loss_chunk_tokens=1024, **common)
    assert parts["loss_chunk"] == 2048 * shape.vocab * 2  # bf16 logits of the largest chunk
    assert "loss_chunk" not in memory_parts(shape, 3366, fused_ce=True, **common)
    assert "loss_chunk" not in memory_parts(shape, 3366, fused_ce=False, loss_chunk_tokens=1024, **common)


def _plan(shape: str, budget: float | None, loss_chunk_tokens, fused_ce: bool = True):
    return plan_training(ModelShape.from_config(ARCHS[shape]), free_mib=141 * 1024, max_row=1024, mean_row=317.0,
                         rows_per_step=32, packing=True, micro_batch_tokens=None, checkpointing="auto",
                         four_bit=True, lora_r=16, lora_targets="all-linear", fused_ce=fused_ce, upcast=False,
                         dequantize=True, compile_layers=True, cuda_graphs="auto", budget_gib=budget,
                         loss_chunk_tokens=loss_chunk_tokens)


PLAN_KEYS = ("micro_batch_tokens", "gradient_accumulation_steps", "gradient_checkpointing", "dequantize_base",
             "cuda_graphs")


@pytest.mark.parametrize("shape, budget", [("qwen3-0.6b", None), ("qwen3-0.6b", 12), ("qwen3-8b", None),
                                           ("qwen3-8b", 24)])
def test_auto_takes_1024_token_chunks_where_the_benchmarks_plans_stay_as_they_are(shape, budget):
    """The benchmark's shapes and budgets, where the 1,024-token chunks were measured (docs/gpus.md): the same plan
    as with Liger's own chunks, plus the larger chunk's logits."""
    own, auto = _plan(shape, budget, None), _plan(shape, budget, "auto")
    assert auto.loss_chunk_tokens == AUTO_LOSS_CHUNK_TOKENS == 1024 and own.loss_chunk_tokens is None
    assert [getattr(auto, k) for k in PLAN_KEYS] == [getattr(own, k) for k in PLAN_KEYS]
    assert auto.predicted_peak_gib > own.predicted_peak_gib
    assert any("chunks of at least 1024 tokens (train.loss_chunk_tokens=auto)" in r for r in auto.reasons)


def test_auto_keeps_liger_s_own_chunks_where_the_larger_ones_would_change_the_plan():
    """Across budgets, `auto` is the chunked plan where that plan keeps everything else, and Liger's own (saying why)
    where the chunk's logits would cost micro-batch tokens, checkpointing or graphs; both cases occur."""
    seen = set()
    for tenths in range(50, 200, 2):
        budget = tenths / 10
        own, chunked, auto = (_plan("qwen3-0.6b", budget, x) for x in (None, 1024, "auto"))
        same = [getattr(chunked, k) for k in PLAN_KEYS] == [getattr(own, k) for k in PLAN_KEYS]
        assert auto.loss_chunk_tokens == (1024 if same else None), budget
        assert [getattr(auto, k) for k in PLAN_KEYS] == [getattr(own, k) for k in PLAN_KEYS], budget
        if not same:
            assert "Liger's own loss chunks (train.loss_chunk_tokens=auto)" in auto.reasons[-1]
        seen.add(same)
    assert seen == {True, False}


def test_chunks_only_where_liger_s_fused_loss_runs():
    assert _plan("qwen3-0.6b", None, "auto", fused_ce=False).loss_chunk_tokens is None
    assert _plan("qwen3-0.6b", None, 2048, fused_ce=False).loss_chunk_tokens is None
    assert _plan("qwen3-0.6b", None, 2048).loss_chunk_tokens == 2048


def test_only_a_liger_that_sizes_its_chunks_is_taken_for_one():
    assert takes_chunk_sizes("0.8.5") and takes_chunk_sizes("0.9.1") and takes_chunk_sizes("1.0.0")
    assert not takes_chunk_sizes("0.8.4") and not takes_chunk_sizes("0.6.2") and not takes_chunk_sizes("0.8.5.dev1")
    assert not takes_chunk_sizes(None)


def test_an_older_liger_keeps_its_own_chunks_under_auto_and_refuses_a_size_before_loading():
    """Liger before 0.8.5 has no `chunk_mem_const`: `auto` plans with Liger's own chunks there, and a size asked for
    stops the run when the environment is verified, naming the key and the installed version."""
    cfg = load_config(None, [])
    assert cfg.train.loss_chunk_tokens == "auto"
    assert loss_chunk_setting(cfg, True, "0.8.4") is None
    assert loss_chunk_setting(cfg, True, "0.8.5") == "auto"
    assert loss_chunk_setting(cfg, False, "0.8.4") == "auto"  # Liger off: nothing to size (the planner ignores it)
    sized = load_config(None, ["train.loss_chunk_tokens=1024"])
    assert loss_chunk_setting(sized, True, "0.8.5") == 1024
    with pytest.raises(UserInputError, match=r"train.loss_chunk_tokens=1024 needs liger-kernel >= 0.8.5 .*"
                                             r"installed: 0.8.4"):
        loss_chunk_setting(sized, True, "0.8.4")
    assert loss_chunk_setting(load_config(None, ["train.loss_chunk_tokens=null"]), True, "0.8.4") is None
