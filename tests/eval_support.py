"""Shared set-up for the evaluation and training-path tests: a tiny generated model quantized to 4-bit on the CPU,
in-process, and one training micro-batch through the training worker's model."""

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


def trained_once(base: QuantizedModel, seed: int = 0, lengths: tuple[int, ...] = (20,), **plan: object):
    """The training worker's model (build_model, fp32 on the CPU, LoRA dropout 0) over `base` with a TrainingPlan of
    `plan`'s fields, after a forward and backward pass per length in `lengths` on fixed token ids (a non-zero LoRA B,
    so the gradients reach A too): (model, the last loss, each trainable parameter's gradient)."""
    import torch

    from finetune_flows.config.plan import Plan
    from finetune_flows.config.schema import FinetuneConfig
    from finetune_flows.training.planner import TrainingPlan
    from finetune_flows.training.worker import build_model

    cfg = FinetuneConfig.model_validate({"lora": {"dropout": 0.0}})
    run_plan = Plan(device="cpu", nproc=1, precision="fp32", compute_dtype="float32", train_attn="sdpa",
                    eval_attn="sdpa", eval_dtype="float32")
    tplan = TrainingPlan(**{"packing": False, "micro_batch_tokens": 0, "micro_batch_rows": 2,
                            "gradient_accumulation_steps": 1, "gradient_checkpointing": False, "tokens_per_step": 40.0,
                            "predicted_peak_gib": 0.0, "budget_gib": None, "reasons": [], **plan})
    torch.manual_seed(1)  # the same LoRA initialisation
    model = build_model(cfg, run_plan, tplan, base.path, True, {"": "cpu"}, upcast=False)
    for module in model.modules():
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight, std=0.02, generator=torch.Generator().manual_seed(2))
    model.train()
    for length in lengths:
        ids = torch.randint(3, 1000, (2, length), generator=torch.Generator().manual_seed(seed + length))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return model, loss.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
