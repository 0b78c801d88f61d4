"""The evaluation copy of the base model: the 4-bit weights dequantized once, in the compute dtype, and cached.

A bitsandbytes Linear4bit re-dequantizes its weight on every call (or runs a fused 4-bit kernel), which makes
generation launch-bound and cannot be compiled or CUDA-graphed. The copy holds, for every Linear4bit, exactly
the matrix the 4-bit matmul multiplies by: `bitsandbytes.functional.dequantize_4bit` of the packed weight with
its quantization state, produced directly in the compute dtype as bnb's `gemm_4bit` fallback does
(`dequantize_4bit(..., dtype=A.dtype)` then `F.linear`). Every other parameter (embeddings, norms, lm_head) is
taken unchanged from the 4-bit model as loaded. So the copy is bf16 on GPUs (fp32 on the CPU) and equals the
dequantized 4-bit weights bit for bit (tests/test_dequantize.py). One caveat: in eval mode on CPUs with
AVX512-BF16, bnb runs a fused kernel that rounds activations and scales to bf16 whatever the compute dtype, so
the 4-bit model's CPU *evaluation* differs from the fp32 copy at the 1e-3 level; the copy matches what QLoRA
training computed with (train mode always multiplies by the dequantized weight).

transformers' `model.dequantize(dtype)` dequantizes into the dtype recorded at quantization time and then casts;
in this pipeline that dtype is the compute dtype, so it yields the same weights, but it is not guaranteed when
the two differ, and it leaves the bias dtype as stored. This module is the one place that makes the copy.

API (small on purpose):
- `dequantized_copy(base, cache_root, device)` -> directory of a plain transformers checkpoint (plus tokenizer),
  a store entry (`<cache>/dequantized/<key>/`, finetune_flows/store/entries.py) made once per (4-bit checkpoint,
  compute dtype, device type) under the entry's lock and reused once its manifest verifies;
- `dequantize_model(model)` -> the same model object with every Linear4bit replaced by an nn.Linear in place;
- `dequantize_linear4bit(module)` -> the weight matrix one Linear4bit computes with.
"""

from __future__ import annotations

import copy
import gc
import re
import time
from pathlib import Path

from pydantic import BaseModel

from finetune_flows.models.quantize import QuantizedModel, torch_dtype
from finetune_flows.store.entries import Entry, reuse_or_produce
from finetune_flows.store.fingerprint import code_version, combine


def dequantize_linear4bit(module, dtype=None):
    """The weight (out_features x in_features) a bnb Linear4bit multiplies by, in `dtype` (default: its compute
    dtype), on the module's device."""
    import bitsandbytes.functional as F

    state = copy.copy(module.weight.quant_state)
    state.dtype = dtype or module.compute_dtype or state.dtype  # dequantize straight into it, as gemm_4bit does
    return F.dequantize_4bit(module.weight.data, state)


def dequantize_model(model, offload_to_cpu: bool = False) -> int:
    """Replace every Linear4bit of `model` by an nn.Linear holding its dequantized weight (compute dtype); one
    quantized from a Conv1D (GPT-2) by a Conv1D again.

    With offload_to_cpu the new layers land on the CPU as they are made, so a GPU only ever holds the 4-bit
    model plus one dequantized matrix. Returns the number of layers replaced.
    """
    import bitsandbytes as bnb
    import torch
    from transformers.pytorch_utils import Conv1D

    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        weight = dequantize_linear4bit(module)
        target = "cpu" if offload_to_cpu else weight.device
        if issubclass(getattr(module, "source_cls", torch.nn.Linear), Conv1D):
            # GPT-2's Conv1D (quantized transposed): back to a Conv1D, (in x out), so a saved copy loads as GPT-2
            with torch.device("meta"):
                linear = Conv1D(module.out_features, module.in_features)  # always with a bias, as GPT-2's
            weight = weight.T.contiguous()
        else:
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                     device="meta")
        linear.weight = torch.nn.Parameter(weight.to(target), requires_grad=False)
        if module.bias is not None:  # Linear4bit.forward casts the bias to the compute dtype too
            linear.bias = torch.nn.Parameter(module.bias.data.to(device=target, dtype=weight.dtype),
                                             requires_grad=False)
        model.set_submodule(name, linear)
        replaced += 1
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # Loading recorded how to turn serialized 4-bit tensors into params; saving would try to reverse that
        # (and transformers cannot), but the params are plain now, so those conversions no longer apply.
        load_ops = tuple(quantizer.get_load_operations().values())
        model._weight_conversions = [c for c in getattr(model, "_weight_conversions", None) or []
                                     if not any(isinstance(op, load_ops) for op in getattr(c, "operations", []))]
        quantizer.remove_quantization_config(model)  # the result is a plain checkpoint
    if offload_to_cpu:
        model.to("cpu")
    # The replaced Linear4bit layers sit in reference cycles, so their 4-bit weights outlive them until Python's
    # cyclic collector happens to run, and stay allocated through the training steps.
    gc.collect()
    return replaced


class DequantizedCopy(BaseModel):
    """What an evaluation copy was made from, as its entry's manifest holds it."""

    path: Path
    source: str
    base_fingerprint: str
    dtype: str
    device: str
    linear_layers: int
    seconds: float


def copy_key(base: QuantizedModel, device_type: str) -> str:
    """What the copy is made from, readable (the 4-bit entry's key, the dtype, the device type), then a hash of that
    and this module's source."""
    made_from = re.sub(r"[^A-Za-z0-9.-]+", "-", f"{base.fingerprint[:24]}-{base.compute_dtype}-{device_type}")
    code = code_version("models/dequantize")
    return f"{made_from}-{combine(base.fingerprint, base.compute_dtype, device_type, code)[:12]}"


def dequantized_copy(base: QuantizedModel, cache_root: Path, device: str = "cpu",
                     trust_remote_code: bool = False) -> Path:
    """The evaluation copy of `base` (a 4-bit checkpoint), made on `device` as the store entry
    `<cache_root>/dequantized/<key>`; a base that is not 4-bit is returned as it is.

    The dequantization runs on `device` (e.g. "cuda:0") so the copy holds the values that device's kernels produce.
    One writer at a time (the entry's lock: a second evaluation waits, then reuses it); the manifest, written last,
    marks it complete, so a copy whose writer died is made again, never loaded.
    """
    if not base.load_in_4bit:
        return Path(base.path)
    import torch

    device_type = torch.device(device).type
    entry = Entry(cache_root, "dequantized", copy_key(base, device_type))

    def produce() -> DequantizedCopy:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(base.path, device_map={"": device},
                                                     dtype=torch_dtype(base.compute_dtype),
                                                     trust_remote_code=trust_remote_code)
        layers = dequantize_model(model, offload_to_cpu=device_type != "cpu")
        model.save_pretrained(entry.path)
        AutoTokenizer.from_pretrained(base.path, trust_remote_code=trust_remote_code).save_pretrained(entry.path)
        print(f"dequantized {layers} Linear4bit layers of {base.path} to {base.compute_dtype} on {device} -> "
              f"{entry.path}", flush=True)
        return DequantizedCopy(path=entry.path, source=str(base.path), base_fingerprint=base.fingerprint,
                               dtype=base.compute_dtype, device=device_type, linear_layers=layers,
                               seconds=round(time.perf_counter() - started, 2))

    made, _ = reuse_or_produce(entry, DequantizedCopy, produce, outputs=["."])  # ".": every file it holds
    return made.path
