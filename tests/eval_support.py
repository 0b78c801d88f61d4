"""Shared set-up for the evaluation tests: a tiny generated model quantized to 4-bit on the CPU, in-process."""

from __future__ import annotations

import json
from pathlib import Path

from finetune_flows.config.schema import QuantizationConfig
from finetune_flows.models.sources import materialize_model
from finetune_flows.models.quantize import QuantizedModel, bnb_config, count_4bit_layers, torch_dtype
from finetune_flows.store.runs import atomic_dir


def tiny_quantized(cache: Path, compute_dtype: str = "float32") -> QuantizedModel:
    """generated:tiny-llama as a saved 4-bit (nf4, double-quant) checkpoint, built once per cache and dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cache / "tiny-4bit" / compute_dtype
    if not (out / "quantization.json").is_file():
        src = materialize_model("generated:tiny-llama", cache)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=bnb_config(QuantizationConfig(),
                                                     compute_dtype), device_map={"": "cpu"},
                                                     dtype=torch_dtype(compute_dtype))
        with atomic_dir(out) as tmp:
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
            (tmp / "quantization.json").write_text(json.dumps({"layers": count_4bit_layers(model)}))
    return QuantizedModel(path=out, fingerprint=f"tiny-4bit-{compute_dtype}", load_in_4bit=True,
                          compute_dtype=compute_dtype, memory_footprint_mb=0.0, linear4bit_layers=14,
                          quantize_seconds=0.0)
