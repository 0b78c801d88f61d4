"""Packed training batches: the same logits, loss and labels as one row at a time, and a schedule that is fair to
every rank and unchanged by an out-of-memory split."""

from __future__ import annotations

import random

import pytest
import torch

from finetune_flows.models.attention import packed_kernel_for, use_packed_attention, varlen_attention
from finetune_flows.data.dataset import IGNORE_INDEX
from finetune_flows.data.packing import PackedCollator, build_schedule, fill_packs, split_pack


def tiny_qwen3(kv_heads: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
                               max_position_embeddings=512)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


def random_rows(lengths, prompt: int = 3, seed: int = 0):
    rng = random.Random(seed)
    rows = []
    for n in lengths:
        ids = [rng.randrange(300) for _ in range(n)]
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * min(prompt, n) + ids[prompt:]})
    return rows


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain multi-head and grouped-query attention
def test_packed_logits_equal_per_row_logits(kv_heads):
    model = tiny_qwen3(kv_heads)
    rows = random_rows([5, 17, 9, 30, 1])
    with torch.no_grad():
        per_row = torch.cat([model(input_ids=torch.tensor([r["input_ids"]])).logits[0] for r in rows])
        use_packed_attention(model, "rows")
        packed = model(**PackedCollator(0)([rows])).logits[0]
    assert packed.shape == per_row.shape
    torch.testing.assert_close(packed, per_row, rtol=1e-5, atol=1e-5)


def test_no_token_attends_across_rows():
    """Changing one row's tokens leaves every other row's logits exactly as they were."""
    model = tiny_qwen3()
    use_packed_attention(model, "rows")
    rows = random_rows([12, 20, 8])
    changed = [rows[0], random_rows([20], seed=99)[0], rows[2]]
    with torch.no_grad():
        a = model(**PackedCollator(0)([rows])).logits[0]
        b = model(**PackedCollator(0)([changed])).logits[0]
    torch.testing.assert_close(a[:12], b[:12])
    torch.testing.assert_close(a[32:], b[32:])
    assert not torch.allclose(a[12:32], b[12:32])


def test_packed_loss_equals_the_token_weighted_per_row_loss():
    model = tiny_qwen3()
    rows = random_rows([6, 25, 14], prompt=4)
    with torch.no_grad():
        sums = []
        for r in rows:
            out = model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]]))
            n = sum(1 for x in r["labels"][1:] if x != IGNORE_INDEX)
            sums.append((float(out.loss) * n, n))
        use_packed_attention(model, "rows")
        packed = float(model(**PackedCollator(0)([rows])).loss)
    assert packed == pytest.approx(sum(s for s, _ in sums) / sum(n for _, n in sums), rel=1e-5)


def test_masking_is_preserved_and_rows_never_predict_the_next_row():
    rows = random_rows([5, 7], prompt=3)
    batch = PackedCollator(0)([rows])
    labels = batch["labels"][0].tolist()
    assert labels[:5] == [IGNORE_INDEX] * 3 + rows[0]["input_ids"][3:]
    # the second row's first label is ignored (its own prompt here anyway), the rest is its own labels
    assert labels[5:] == [IGNORE_INDEX] + rows[1]["labels"][1:]
    assert batch["position_ids"][0].tolist() == list(range(5)) + list(range(7))
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 12] and batch["max_length_q"] == 7
    assert isinstance(batch["max_length_q"], int)  # varlen kernels want a host int, not a tensor
    text_row = {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}  # text format: every token has a label
    assert PackedCollator(0)([[text_row, text_row]])["labels"][0].tolist() == [IGNORE_INDEX, 2, 3, IGNORE_INDEX, 2, 3]


def test_varlen_rows_kernel_matches_dense_causal_attention_per_row():
    torch.manual_seed(1)
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, 7, 8 ** -0.5, "rows")
    for a, b in ((0, 3), (3, 10)):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].repeat_interleave(2, 1).transpose(0, 1),
            v[a:b].repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[a:b], ref)


@pytest.mark.parametrize("tokens_limit", [64, 8])
def test_compiled_rows_kernel_masks_small_micro_batches_and_loops_over_larger_ones(monkeypatch, tokens_limit):
    """Inside torch.compile the `rows` kernel is one masked attention (no graph break) up to MASKED_ROWS_TOKENS, and
    the row loop above it (a graph break, but no tokens-squared mask); both give the eager kernel's output, empty
    padding rows at the end included."""
    from finetune_flows.models import attention
    from finetune_flows.training.compiling import compile_stats

    monkeypatch.setattr(attention, "MASKED_ROWS_TOKENS", tokens_limit)
    torch.manual_seed(1)
    q, k, v = torch.randn(20, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    cu = torch.tensor([0, 3, 10, 20, 20], dtype=torch.int32)
    want = varlen_attention(q, k, v, cu, 10, 8 ** -0.5, "rows")
    torch._dynamo.reset()
    try:
        before = compile_stats()["graph_breaks"]
        compiled = torch.compile(varlen_attention, backend="aot_eager", dynamic=False)
        got = compiled(q, k, v, cu, 10, 8 ** -0.5, "rows")
        breaks = compile_stats()["graph_breaks"] - before
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    assert (breaks == 0) == (tokens_limit >= 20)


@pytest.mark.train
def test_compiled_layers_call_the_flash_kernel_untraced(monkeypatch):
    """Decoder layers under torch.compile call the flash varlen function as itself, never traced by Dynamo (FA4's
    launcher is Python that JIT-compiles kernels). flash-attn cannot run on this CPU: a stand-in module records how
    it is called and computes with the rows kernel."""
    import sys
    import types

    from finetune_flows.models import attention

    calls = []

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal):
        calls.append((torch.compiler.is_compiling(), type(max_seqlen_q), causal))
        return varlen_attention(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, "rows"), None

    model, rows = tiny_qwen3(2), random_rows([5, 17, 9])  # transformers imported before the stand-in exists
    stand_in = types.ModuleType("flash_attn")
    stand_in.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in)
    attention._flash_varlen.cache_clear()
    try:
        with torch.no_grad():
            use_packed_attention(model, "rows")
            expected = model(**PackedCollator(0)([rows])).logits
            use_packed_attention(model, "fa2")
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer.compile(backend="eager", dynamic=True)
            got = model(**PackedCollator(0)([rows])).logits
    finally:
        attention._flash_varlen.cache_clear()
        use_packed_attention(model, "rows")
        torch._dynamo.reset()
    torch.testing.assert_close(got, expected)
    assert calls == [(False, int, True)] * 2  # once per layer, outside the traced graph, with a Python-int length


@pytest.mark.parametrize("torch_api", ["2.11", "2.12"])
def test_torch_varlen_kernel_is_called_as_each_torch_version_spells_it(monkeypatch, torch_api):
    """`torch.nn.attention.varlen.varlen_attn` is CUDA-only, and its keywords changed: torch 2.10/2.11 take
    `is_causal` and always scale by 1/sqrt(head_dim), with no grouped-query support; 2.12 takes `scale`,
    `enable_gqa` and a causal `window_size`. A stand-in of each signature (computing with the rows kernel) must give
    the rows kernel's logits, the keywords worked out once when the kernel is chosen."""
    from finetune_flows.models import attention

    seen = []
    if torch_api == "2.11":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
            seen.append((query.shape[1] == key.shape[1], is_causal))  # heads repeated for it
            return varlen_attention(query, key, value, cu_seq_q, max_q, query.shape[-1] ** -0.5, "rows")
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, enable_gqa=False,
                        window_size=(-1, -1)):
            seen.append((enable_gqa, window_size))
            return varlen_attention(query, key, value, cu_seq_q, max_q, scale, "rows")

    model, rows = tiny_qwen3(2), random_rows([5, 17, 9])
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.2  # not 1/sqrt(16): the 2.11 path must rescale the queries itself
    monkeypatch.setattr(attention, "_torch_varlen", lambda: varlen_attn)
    try:
        with torch.no_grad():
            use_packed_attention(model, "rows")
            expected = model(**PackedCollator(0)([rows])).logits
            use_packed_attention(model, "torch_varlen")
            got = model(**PackedCollator(0)([rows])).logits
    finally:
        use_packed_attention(model, "rows")
    torch.testing.assert_close(got, expected)
    assert seen == [(True, True)] * 2 if torch_api == "2.11" else seen == [(True, (-1, 0))] * 2


@pytest.mark.train
def test_compiled_decoder_layers_compile_once_for_every_layer_and_packed_length():
    """Training compiles each decoder layer (finetune_flows/training/compiling.py compile_decoder_layers). The first
    layer's input comes from the frozen embedding; unless it requires grad like every later layer's input, Dynamo
    compiles the layer twice (on an H200 a Qwen3-0.6B run spent ~100 s compiling before its first step). Dynamo's own
    backend, so no kernels are built; a recompile is an error here."""
    from peft import LoraConfig, get_peft_model

    from finetune_flows.training.compiling import compile_decoder_layers

    model = get_peft_model(tiny_qwen3(2).train(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules="all-linear", task_type="CAUSAL_LM"))
    model.config.use_cache = False  # as build_model sets it for training
    use_packed_attention(model, "rows")
    torch._dynamo.reset()
    try:
        compile_decoder_layers(model, backend="eager")
        with torch._dynamo.config.patch(error_on_recompile=True):
            for lengths in ([5, 17], [30, 2, 11, 6]):  # two packed lengths and row counts: one dynamic graph
                model(**PackedCollator(0)([random_rows(lengths)])).loss.backward()
    finally:
        torch._dynamo.reset()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert grads and all(g is not None for g in grads)


def test_kernel_choice_follows_the_backend_and_falls_back_on_the_cpu():
    assert packed_kernel_for("flash_attention_4", on_gpu=False) == "rows"
    assert packed_kernel_for("flash_attention_4", on_gpu=True) == "fa4"
    assert packed_kernel_for("flash_attention_2", on_gpu=True) == "fa2"
    assert packed_kernel_for("eager", on_gpu=True) == "rows"


def test_packs_respect_the_budget_and_cover_every_row_once_per_epoch():
    rng = random.Random(3)
    lengths = [rng.randint(10, 300) for _ in range(500)]
    packs = fill_packs(lengths, list(range(500)), 1000)
    assert sorted(i for p in packs for i in p) == list(range(500))
    assert all(sum(lengths[i] for i in p) <= 1000 for p in packs)
    assert fill_packs([50, 5000, 50], [0, 1, 2], 1000) == [[0], [1], [2]]  # a longer row gets a pack of its own


def test_schedule_balances_ranks_by_tokens():
    rng = random.Random(4)
    lengths = [max(32, min(1024, int(rng.lognormvariate(5.5, 0.7)))) for _ in range(2000)]
    s = build_schedule(lengths, budget=8000, accumulation=2, world=2, seed=1, max_steps=20)
    assert s.steps == 20 and s.accumulation == 2 and len(s.micro_batches) == 20 * 2 * 2
    per_rank = [sum(lengths[i] for mb in s.micro_batches[r::2] for i in mb) for r in range(2)]
    assert abs(per_rank[0] - per_rank[1]) / max(per_rank) < 0.02  # within 2%: no straggler waits
    assert s == build_schedule(lengths, budget=8000, accumulation=2, world=2, seed=1, max_steps=20)


def test_an_oom_split_keeps_every_optimizer_step_on_the_same_rows():
    rng = random.Random(5)
    lengths = [rng.randint(20, 400) for _ in range(600)]
    whole = build_schedule(lengths, budget=3000, accumulation=2, world=2, seed=7, max_steps=6)
    halves = build_schedule(lengths, budget=3000, accumulation=2, world=2, seed=7, max_steps=6, split=2)
    assert halves.accumulation == 4 and len(halves.micro_batches) == 2 * len(whole.micro_batches)

    def rows_of(schedule, rank, step):
        per_rank = schedule.micro_batches[rank::2]
        return sorted(i for mb in per_rank[step * schedule.accumulation:(step + 1) * schedule.accumulation] for i in mb)

    for rank in range(2):
        for step in range(6):
            assert rows_of(whole, rank, step) == rows_of(halves, rank, step)


def test_split_pack_keeps_order_and_balance():
    lengths = [100, 100, 100, 100]
    assert split_pack([0, 1, 2, 3], lengths, 2) == [[0, 1], [2, 3]]
    assert split_pack([0], lengths, 2) == [[], [0]] or split_pack([0], lengths, 2) == [[0], []]
    empty = PackedCollator(7)([[]])  # an empty piece is one ignored token: every DDP rank stays in step
    assert empty["input_ids"].tolist() == [[7]] and empty["labels"].tolist() == [[IGNORE_INDEX]]


@pytest.mark.train
def test_compiled_layers_under_activation_checkpointing_train_as_the_eager_layers_do():
    """Within a memory budget the planner can hold the base dequantized with compiled layers *and* checkpoint them
    (Qwen3-8B within 24 GiB). Set up as build_model does it (checkpointing before the adapter, compiling after), with
    the checkpoint around each compiled layer or inside its graph (as with CUDA graphs; AOTAutograd's own backend,
    so no kernels are built): the same loss and LoRA gradients as the eager model without checkpointing, no
    recompile, and activations kept for the backward pass about as few as with the eager checkpoint, a fraction of
    the compiled layers' without it."""
    from peft import LoraConfig, get_peft_model

    from finetune_flows.training.compiling import compile_decoder_layers

    def model(checkpointed: bool):
        base = tiny_qwen3(2).train()
        for p in base.parameters():
            p.requires_grad_(False)
        if checkpointed:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                               task_type="CAUSAL_LM", init_lora_weights=False))
        peft.config.use_cache = False
        use_packed_attention(peft, "rows")
        return peft

    def step(m):
        params = {p.data_ptr() for p in m.parameters()}
        kept: list[int] = []

        def pack(t):  # what autograd keeps for the backward pass, the weights aside
            if t.data_ptr() not in params:
                kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            losses = [m(**PackedCollator(0)([random_rows(lengths, seed=i)])).loss
                      for i, lengths in enumerate(([5, 17], [30, 2, 11, 6]))]
        sum(losses).backward()
        return [x.detach() for x in losses], {n: p.grad for n, p in m.named_parameters() if "lora_" in n}, sum(kept)

    want_losses, want_grads, _ = step(model(False))
    _, _, eager_checkpoint = step(model(True))
    torch._dynamo.reset()
    try:
        uncheckpointed = model(False)
        compile_decoder_layers(uncheckpointed, backend="aot_eager")
        _, _, compiled_all = step(uncheckpointed)
        runs = {}
        for in_graph in (False, True):  # the eager checkpoint around each compiled layer, or inside its graph
            compiled = model(True)
            compile_decoder_layers(compiled, checkpoint_in_graph=in_graph, backend="aot_eager")
            with torch._dynamo.config.patch(error_on_recompile=True):
                runs[in_graph] = step(compiled)
            layers = compiled.get_base_model().model.layers
            assert all(layer._compiled_call_impl is not None for layer in layers)
            assert all(layer.gradient_checkpointing is not in_graph for layer in layers)
    finally:
        torch._dynamo.reset()
    for losses, grads, kept in runs.values():
        torch.testing.assert_close(losses, want_losses)
        assert grads.keys() == want_grads.keys() and all(g is not None for g in grads.values())
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], msg=name)
        assert kept < 1.25 * eager_checkpoint and kept < compiled_all / 2, (kept, eager_checkpoint, compiled_all)


def lora_tiny():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_qwen3(2).train(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules="all-linear", task_type="CAUSAL_LM",
                                                           init_lora_weights=False))
    model.config.use_cache = False
    use_packed_attention(model, "rows")
    return model


def losses_and_grads(model, collator, packs):
    batches = [collator([pack]) for pack in packs]
    losses = [model(**batch).loss for batch in batches]
    sum(losses).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
    model.zero_grad(set_to_none=True)
    return batches, [x.detach() for x in losses], grads


def test_fixed_shape_micro_batches_share_one_shape_and_train_as_the_packed_ones_do():
    """CUDA graphs replay one shape: every micro-batch is padded to it with ignored rows of their own, and the loss
    and LoRA gradients are those of the packed micro-batches without padding."""
    from finetune_flows.data.packing import FixedShape

    packs = [random_rows([5, 17]), random_rows([30, 2, 11, 6], seed=1), []]  # [] an empty piece of a split pack
    model = lora_tiny()
    _, want_losses, want_grads = losses_and_grads(model, PackedCollator(0), packs[:2])
    fixed = FixedShape(tokens=64, segments=7, max_length=30)
    collator = PackedCollator(0, fixed)
    batches, losses, grads = losses_and_grads(model, collator, packs[:2])
    torch.testing.assert_close(losses, want_losses)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], msg=name)
    batches.append(collator([packs[2]]))
    for batch in batches:
        assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, 64)
        assert batch["cu_seq_lens_q"].shape == (8,) and batch["cu_seq_lens_q"][-1] == 64
        assert batch["max_length_q"] == batch["max_length_k"] == 30
    second = batches[1]
    assert second["cu_seq_lens_q"].tolist() == [0, 30, 32, 43, 49, 64, 64, 64]  # 15 padding tokens: one row
    assert (second["labels"][0, 49:] == IGNORE_INDEX).all()
    assert second["position_ids"][0, 49:].tolist() == list(range(15))
    assert collator.tokens == 0 and list(collator._built) == [22, 49, 0]  # real tokens only are counted


def test_the_fixed_shape_holds_every_micro_batch_of_the_schedule_and_refuses_a_larger_one():
    from finetune_flows.data.packing import FixedShape

    rng = random.Random(3)
    lengths = [rng.randrange(1, 90) for _ in range(200)] + [300]  # one row longer than the budget: a pack of its own
    schedule = build_schedule(lengths, 256, 2, 1, seed=0, max_steps=-1, epochs=2)
    fixed = FixedShape.for_schedule(schedule, lengths, 256)
    assert fixed.tokens == 300 and fixed.max_length == 300
    rows = [{"input_ids": [1] * n, "labels": [1] * n} for n in lengths]
    collator = PackedCollator(0, fixed)
    shapes = {tuple(collator([[rows[i] for i in mb]])["cu_seq_lens_q"].shape) for mb in schedule.micro_batches}
    assert shapes == {(fixed.segments + 1,)}
    with pytest.raises(ValueError, match="does not fit the fixed shape"):
        collator([[rows[-1], rows[0]]])


@pytest.mark.train
def test_cuda_graph_layers_compile_once_for_micro_batches_of_one_shape():
    """train.cuda_graphs: the layers compiled with static shapes in mode "reduce-overhead" (on the CPU Inductor
    records no CUDA graph but compiles the same static graph): one compilation serves every layer and every
    micro-batch of the fixed shape, and the loss is the eager one."""
    from finetune_flows.data.packing import FixedShape
    from finetune_flows.training.compiling import compile_decoder_layers
    packs = [random_rows([5, 17]), random_rows([30, 2, 11, 6], seed=1)]
    collator = PackedCollator(0, FixedShape(tokens=64, segments=7, max_length=30))
    eager = lora_tiny()
    _, want, _ = losses_and_grads(eager, collator, packs)
    model = lora_tiny()
    torch._dynamo.reset()
    try:
        compile_decoder_layers(model, cuda_graphs=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            _, losses, grads = losses_and_grads(model, collator, packs)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(losses, want, rtol=1e-4, atol=1e-4)
    assert grads and all(g.abs().sum() > 0 for g in grads.values())
