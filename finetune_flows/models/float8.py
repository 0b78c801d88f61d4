"""The frozen base's matmuls in FP8 (`train.fp8_base`): the dequantized NF4 weights stored as float8 (e4m3) with
one scale per row, multiplied by FP8 activations through `torch._scaled_mm` (FP8 tensor cores on compute capability
8.9+, twice the bf16 rate on an H100/H200; it also runs on the CPU, for tests).

A frozen linear layer needs two matmuls per step, both against its weight W (out x in): y = x W^T forward and
dx = dy W backward (no weight gradient). `_scaled_mm(a, b)` wants `a` row-major and `b` column-major, with a scale per
row of `a` and per column of `b`, so each layer holds W in FP8 twice (one byte a weight each, the two copies as much
memory as the bf16 weight): W scaled per output channel for the forward pass, W^T scaled per input channel for the
backward. Activations and output gradients are scaled per token, as they come.

This is not the QLoRA computation: every weight is rounded from its dequantized NF4 value to FP8's 3-bit mantissa,
and every activation too (about 4% relative error in a matmul of Gaussian data, tests/test_float8.py). The adapter
trained this way is saved, evaluated and merged against the NF4 base as usual, so the evaluation measures what the
rounding costs.
"""

from __future__ import annotations

import functools

FP8_MAX = 448  # the largest float8_e4m3fn value (an int: Dynamo lifts a global float to a graph input)


def quantize_rows(t):
    """(t in float8_e4m3fn, the float32 scale per row that multiplies it back), for a 2-D tensor."""
    import torch

    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _matmul(a, a_scale, b_rows, b_scale, out_dtype):
    """a (m x k, FP8, row-major) times b (k x n, given as its n x k FP8 rows: column-major), both scaled."""
    import torch

    return torch._scaled_mm(a, b_rows.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)


@functools.cache
def _classes():
    """The autograd Function and the module class, made once: every FP8 layer must be of one class, else Dynamo's
    guard on each compiled decoder layer's module types fails for the next layer and recompiles it, until its
    recompile limit leaves the rest of the layers uncompiled."""
    import torch

    class Float8Matmul(torch.autograd.Function):
        """x W^T with FP8 operands; the backward pass gives the input's gradient only (W is frozen)."""

        @staticmethod
        def forward(ctx, x, weight, weight_scale, weight_t, weight_t_scale):
            ctx.save_for_backward(weight_t, weight_t_scale)
            rows = x.reshape(-1, x.shape[-1])
            q, scale = quantize_rows(rows)
            y = _matmul(q, scale, weight, weight_scale, x.dtype)
            return y.reshape(*x.shape[:-1], weight.shape[0])

        @staticmethod
        def backward(ctx, grad):
            weight_t, weight_t_scale = ctx.saved_tensors
            rows = grad.reshape(-1, grad.shape[-1])
            q, scale = quantize_rows(rows)
            dx = _matmul(q, scale, weight_t, weight_t_scale, grad.dtype)
            return dx.reshape(*grad.shape[:-1], weight_t.shape[0]), None, None, None, None

    class Float8Linear(torch.nn.Module):
        """A frozen nn.Linear's FP8 replacement (same in/out features and bias, no trainable parameter)."""

        def __init__(self, source: torch.nn.Linear):
            super().__init__()
            self.in_features, self.out_features = source.in_features, source.out_features
            weight = source.weight.detach()
            q, scale = quantize_rows(weight)  # per output channel
            self.register_buffer("weight_fp8", q)
            self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())
            q, scale = quantize_rows(weight.t().contiguous())  # per input channel
            self.register_buffer("weight_t_fp8", q)
            self.register_buffer("weight_t_scale", scale.reshape(1, -1).contiguous())
            self.bias = (torch.nn.Parameter(source.bias.detach(), requires_grad=False)
                         if source.bias is not None else None)

        def forward(self, x):
            y = Float8Matmul.apply(x, self.weight_fp8, self.weight_scale, self.weight_t_fp8, self.weight_t_scale)
            return y if self.bias is None else y + self.bias.to(y.dtype)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn"

    return Float8Matmul, Float8Linear


def float8_linear(linear):
    """A frozen nn.Linear's FP8 replacement (same in/out features and bias, no trainable parameter)."""
    return _classes()[1](linear)


def float8_base(model) -> int:
    """Replace the frozen base layer of every LoRA-adapted linear layer of a PEFT `model` (over a dequantized base)
    by its FP8 form, freeing its bf16 weight; a layer whose sizes are not multiples of 16 stays as it is. Returns the
    number of layers replaced."""
    import torch
    from peft.tuners.lora import LoraLayer

    replaced = 0
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if (isinstance(module, LoraLayer) and type(base) is torch.nn.Linear
                and base.in_features % 16 == 0 and base.out_features % 16 == 0):  # what _scaled_mm's kernels take
            module.base_layer = float8_linear(base)
            replaced += 1
    # Each rank makes the same FP8 weights from the same base: DDP need not broadcast them at its start (and gloo
    # cannot carry float8). They stay buffers, which CUDA graphs treat as fixed inputs, never copied per replay.
    frozen = [f"{name}.{buffer}" for name, module in model.named_modules() if isinstance(module, _classes()[1])
              for buffer, _ in module.named_buffers(recurse=False)]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    return replaced
