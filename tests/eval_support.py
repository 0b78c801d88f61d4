"""Shared set-up for the evaluation tests: a tiny generated model quantized to 4-bit on the CPU, in-process."""

from __future__ import annotations

from pathlib import Path

from finetune_flows.config.schema import QuantizationConfig
from finetune_flows.models.quantize import QuantizedModel, bnb_config, torch_dtype
from finetune_flows.models.sources import materialize_model
from finetune_flows.store.entries import Entry, reuse_or_produce


def tiny_quantized(cache: Path, compute_dtype: str = "float32") -> QuantizedModel:
    """generated:tiny-llama as a saved 4-bit (nf4, double-quant) checkpoint, a store entry per cache and dtype."""
    entry = Entry(cache, "tiny-4bit", compute_dtype)

    def produce() -> QuantizedModel:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src = materialize_model("generated:tiny-llama", cache)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=bnb_config(QuantizationConfig(),
                                                     compute_dtype), device_map={"": "cpu"},
                                                     dtype=torch_dtype(compute_dtype))
        model.save_pretrained(entry.path)
        AutoTokenizer.from_pretrained(src).save_pretrained(entry.path)
        return QuantizedModel(path=entry.path, fingerprint=f"tiny-4bit-{compute_dtype}", load_in_4bit=True,
                              compute_dtype=compute_dtype, memory_footprint_mb=0.0, linear4bit_layers=14,
                              quantize_seconds=0.0)

    return reuse_or_produce(entry, QuantizedModel, produce, outputs=["."])[0]
