"""Liger's fused linear cross-entropy in larger chunks (train.loss_chunk_tokens).

Liger computes the lm_head's logits, the loss and the input gradient one chunk of tokens at a time, each chunk's
logits no larger than the micro-batch's hidden states (its `chunk_mem_const=1`). A large vocabulary over a small hidden
size makes that a small chunk: Qwen3-0.6B (151,936 x 1,024) gets 32-128 tokens a chunk, 79-106 chunks a micro-batch,
and each chunk's two GEMMs read the whole 311 MB lm_head weight again. With `liger_chunks(tokens)` every call gets the
least `chunk_mem_const` whose chunks hold at least `tokens` tokens (at most twice the power of two at or above it:
planner.largest_chunk, which the memory plan counts), for models whose Liger forward computes its loss through
`LigerForCausalLMLoss` (Qwen, Llama, Mistral and most others). The loss and gradients are the same per token; only
the chunking changes.
"""
from __future__ import annotations

import functools
import inspect


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_mem_const(rows: int, hidden: int, vocab: int, tokens: int) -> int:
    """The least Liger `chunk_mem_const` whose chunks of `rows` tokens hold at least min(`tokens`, `rows`): Liger cuts
    `rows` into cdiv(vocab, chunk_mem_const * hidden) pieces (rounded up to a power of two tokens each)."""
    pieces = max(1, rows // tokens)
    return max(1, _cdiv(vocab, hidden * pieces))


def liger_chunks(tokens: int) -> None:
    """Every later call in this process of Liger's fused linear cross-entropy (`liger_kernel.transformers.functional`)
    with chunks of at least `tokens` tokens where Liger's own are smaller."""
    from liger_kernel.transformers import functional

    current = functional.liger_fused_linear_cross_entropy
    original = getattr(current, "__wrapped__", current)
    if "chunk_mem_const" not in inspect.signature(original).parameters:
        raise RuntimeError("train.loss_chunk_tokens needs liger-kernel >= 0.8.5 (chunk_mem_const)")

    @functools.wraps(original)
    def chunked(input, weight, target, *args, **kwargs):
        rows, hidden = input.shape[-2], input.shape[-1]
        least = chunk_mem_const(rows, hidden, weight.shape[0], tokens)
        kwargs["chunk_mem_const"] = max(kwargs.get("chunk_mem_const", 1), least)
        return original(input, weight, target, *args, **kwargs)

    functional.liger_fused_linear_cross_entropy = chunked
