"""Attention over packed rows, registered with transformers as `finetune_flows_packed`.

A packed micro-batch (data/packing.py) is one row holding several examples; `cu_seq_lens_q` marks where each
starts. This function hands the whole micro-batch to a variable-length kernel, which attends within each example
only and never builds a dense mask over the packed row:

- `fa4`: flash-attention-4's `flash_attn.cute.flash_attn_varlen_func` (Hopper/Blackwell; fed Python-int max
  lengths, which transformers' own FA4 path does not do);
- `fa3` / `fa2`: flash-attn 3 (`flash_attn_interface`) / 2 (`flash_attn`) varlen functions;
- `torch_varlen`: `torch.nn.attention.varlen.varlen_attn` (CUDA, torch >= 2.10);
- `rows`: scaled_dot_product_attention row by row (the CPU, and anywhere else; exact, slower); inside compiled
  layers, for micro-batches of up to MASKED_ROWS_TOKENS, one attention over the whole micro-batch with a mask that
  keeps each row to itself (reading the row bounds on the host would break the graph, and a static-shape graph would
  be compiled again for every micro-batch); the mask and the scores grow with the tokens squared.

Calls without `cu_seq_lens_q` (ordinary padded batches, evaluation) go to transformers' sdpa function unchanged.
Registering is done once per process with `use_packed_attention(model, kernel)`.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

PACKED_ATTENTION = "finetune_flows_packed"
KERNELS = ("fa4", "fa3", "fa2", "torch_varlen", "rows")
# train_attn (the resolved backend name) -> the varlen kernel that serves it for packed batches on a GPU
GPU_KERNEL_FOR = {"flash_attention_4": "fa4", "flash_attention_3": "fa3", "flash_attention_2": "fa2",
                  "sdpa": "torch_varlen", "eager": "rows"}

_kernel = "rows"
MASKED_ROWS_TOKENS = 4096  # the largest micro-batch the compiled `rows` kernel masks (16 heads' scores: 1 GiB)
_torch_varlen_resolved = None  # (varlen_attn, the keywords it takes) once `torch_varlen` is chosen


def packed_kernel_for(train_attn: str, on_gpu: bool) -> str:
    """The varlen kernel for a resolved training backend; `rows` on the CPU or where no varlen kernel exists."""
    if not on_gpu:
        return "rows"
    kernel = GPU_KERNEL_FOR.get(train_attn, "rows")
    if kernel == "torch_varlen" and _torch_varlen() is None:
        return "rows"
    return kernel


@lru_cache(maxsize=None)
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@lru_cache(maxsize=None)
def _flash_varlen(kernel: str):
    if kernel == "fa4":
        from flash_attn.cute import flash_attn_varlen_func
    elif kernel == "fa3":
        from flash_attn_interface import flash_attn_varlen_func
    else:
        from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func


def _flash_attention(q, k, v, cu_seqlens, max_len: int, scale: float, kernel: str):
    out = _flash_varlen(kernel)(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len,
                                max_seqlen_k=max_len, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


_flash_call = _flash_attention  # use_packed_attention() puts it out of torch.compile's reach


def _torch_varlen_call():
    """varlen_attn and the keywords this torch's signature takes; use_packed_attention works them out once, outside
    torch.compile, so the compiled decoder layers trace only the call (inspecting a signature there is Python
    Dynamo would re-run on every trace)."""
    fn = _torch_varlen()
    params = inspect.signature(fn).parameters
    return fn, {name: name in params for name in ("scale", "enable_gqa", "is_causal")}


def varlen_attention(q, k, v, cu_seqlens, max_len: int, scale: float, kernel: str):
    """Causal attention within each packed row. q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]."""
    import torch

    if kernel in ("fa4", "fa3", "fa2"):
        return _flash_call(q, k, v, cu_seqlens, max_len, scale, kernel)
    if kernel == "torch_varlen":
        fn, takes = _torch_varlen_resolved or _torch_varlen_call()  # the first: set by use_packed_attention
        gqa = q.shape[1] != k.shape[1]
        if gqa and not takes["enable_gqa"]:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        kw: dict[str, Any] = {}
        if takes["scale"]:
            kw["scale"] = scale
        elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:  # torch 2.10/2.11 always scale by 1/sqrt(head_dim)
            q = q * (scale * q.shape[-1] ** 0.5)
        if takes["enable_gqa"]:
            kw["enable_gqa"] = gqa
        if takes["is_causal"]:  # torch 2.10/2.11
            kw["is_causal"] = True
        else:  # torch >= 2.12 expresses causality as a window
            kw["window_size"] = (-1, 0)
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kw)
    if torch.compiler.is_compiling() and q.shape[0] <= MASKED_ROWS_TOKENS:
        return _masked_rows(q, k, v, cu_seqlens, scale)
    # rows: exact and device-agnostic
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    gqa = q.shape[1] != k.shape[1]
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                             enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)
    return out


def _masked_rows(q, k, v, cu_seqlens, scale: float):
    """The `rows` kernel from tensor ops alone, for compiled layers: one causal attention whose mask keeps each token
    to its own row (the micro-batch's tokens squared, so for the CPU's small micro-batches)."""
    import torch

    t = torch.arange(q.shape[0], device=q.device)
    row = torch.searchsorted(cu_seqlens[1:].to(q.device), t, right=True)
    mask = (row[:, None] == row[None, :]) & (t[:, None] >= t[None, :])
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask, scale=scale,
                                                           enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def packed_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs):
    """transformers attention interface: query/key/value [B, H, T, D] -> ([B, T, H, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("packed attention does not implement attention dropout; set attention_dropout=0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    dtype = _kernel_dtype(query, value)
    q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))  # [T, H, D]
    out = varlen_attention(q, k, v, cu.to(q.device, non_blocking=True), int(kwargs["max_length_q"]), scale, _kernel)
    return out.unsqueeze(0), None


def _kernel_dtype(query, value):
    """Flash kernels take fp16/bf16 only; with PEFT's fp32 upcast the q/k norms hand us fp32 queries and keys."""
    import torch

    if _kernel == "rows" and not torch.is_autocast_enabled(query.device.type):
        return value.dtype
    low = (torch.float16, torch.bfloat16)
    if value.dtype in low:
        return value.dtype
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return value.dtype


def use_packed_attention(model, kernel: str) -> None:
    """Register the packed attention function and switch the model (and its sub-configs) to it."""
    from transformers import AttentionInterface

    import torch

    global _kernel, _flash_call, _torch_varlen_resolved
    if kernel not in KERNELS:
        raise ValueError(f"unknown packed attention kernel {kernel!r}; known: {', '.join(KERNELS)}")
    _kernel = kernel
    _torch_varlen_resolved = _torch_varlen_call() if kernel == "torch_varlen" else None
    # compiled decoder layers call the flash kernels as one opaque step with their own autograd, instead of Dynamo
    # tracing FA4's CuTe-DSL launcher (Python that JIT-compiles kernels) or flash-attn's wrappers at every new shape
    _flash_call = torch.compiler.disable(_flash_attention, reason="flash-attn varlen kernels are called untraced")
    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    model.set_attn_implementation(PACKED_ATTENTION)
