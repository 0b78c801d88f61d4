"""Checkpoints of families other than Llama's: GPT-2 (config keys n_head/n_embd/n_layer, Conv1D layers, attention
dropout attn_pdrop=0.1) and GPT-NeoX are read through transformers' config class, trained, or refused in one
message before anything loads (the CLI case: tests/test_preflight.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import tiny_checkpoint
from finetune_flows.config.preflight import preflight
from finetune_flows.config.schema import load_config
from finetune_flows.errors import ModelSourceError
from finetune_flows.models.backends import attention_shape
from finetune_flows.training.planner import ModelShape
from finetune_flows.training.sharding import readable_model_shape


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory, shared_cache) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("gpt2") / "gpt2", shared_cache, "gpt2")


def run_config(tmp_path: Path, source: Path | str, *overrides: str):
    return load_config(None, [f"model.source={source}", "hardware.gpus=cpu", "data.builtin_examples=120",
                              f"run.cache_dir={tmp_path / 'c'}", f"run.output_dir={tmp_path / 'runs'}", *overrides])


def test_a_gpt2_checkpoints_shape_is_read_through_its_config_class(gpt2, tmp_path):
    """GPT-2's config.json names n_head, n_embd, n_layer (and n_inner: null for 4x the hidden size): the planners
    read num_attention_heads from it and failed with KeyError in the verify-environment step."""
    from transformers import Gemma3Config

    vocab = json.loads((gpt2 / "config.json").read_text())["vocab_size"]
    expected = ModelShape(hidden=64, intermediate=256, layers=2, heads=4, kv_heads=4, head_dim=16, vocab=vocab,
                          tied=True)
    assert readable_model_shape(str(gpt2)) == ModelShape.from_checkpoint(gpt2) == expected
    assert attention_shape(run_config(tmp_path, gpt2)) == {"heads": 4, "kv_heads": 4, "head_dim": 16}
    # a multimodal config: the shape of its language model (Gemma-3's text_config)
    Gemma3Config(text_config={"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3,
                              "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
                              "vocab_size": 512}).save_pretrained(tmp_path / "gemma3")
    assert readable_model_shape(str(tmp_path / "gemma3")) == ModelShape(
        hidden=96, intermediate=192, layers=3, heads=6, kv_heads=2, head_dim=32, vocab=512, tied=True)


def test_gpt2_attention_dropout_is_refused_for_packed_training_only(gpt2, shared_cache, tmp_path):
    """Packed attention has no dropout: GPT-2's attn_pdrop=0.1 failed the first training step (twice, after a server
    started and the model was quantized). Refused by its own key; padded batches, or attn_pdrop=0, pass."""
    with pytest.raises(ModelSourceError) as info:
        preflight(run_config(tmp_path, gpt2))
    assert str(info.value) == (
        f"model.source={gpt2}: its config sets attn_pdrop=0.1 (attention dropout), which packed training cannot "
        "apply; set train.packing=false (padded batches apply it), or attn_pdrop to 0 in its config.json")
    preflight(run_config(tmp_path, gpt2, "train.packing=false"))
    preflight(run_config(tmp_path, tiny_checkpoint(tmp_path / "nodrop", shared_cache, "gpt2", attn_pdrop=0.0)))
    preflight(run_config(tmp_path, tiny_checkpoint(tmp_path / "neox", shared_cache, "gpt_neox")))


def test_a_4bit_gpt2_trains_and_its_dequantized_copy_loads_as_gpt2(gpt2, tmp_path):
    """bitsandbytes quantizes GPT-2's Conv1D layers transposed, as Linear4bit: the evaluation copy wrote them as
    nn.Linear weights (out x in), which GPT-2 (Conv1D: in x out) refused to load (a size mismatch per layer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.pytorch_utils import Conv1D

    from eval_support import trained_once
    from finetune_flows.config.schema import QuantizationConfig
    from finetune_flows.models.dequantize import dequantized_copy
    from finetune_flows.models.quantize import QuantizedModel, bnb_config

    four_bit = AutoModelForCausalLM.from_pretrained(gpt2, quantization_config=bnb_config(QuantizationConfig(),
                                                    "float32"), device_map={"": "cpu"}, dtype=torch.float32)
    four_bit.save_pretrained(tmp_path / "4bit")
    AutoTokenizer.from_pretrained(gpt2).save_pretrained(tmp_path / "4bit")
    base = QuantizedModel(path=tmp_path / "4bit", fingerprint="gpt2-4bit", load_in_4bit=True, compute_dtype="float32",
                          memory_footprint_mb=0.0, linear4bit_layers=8, quantize_seconds=0.0)
    model, loss, grads = trained_once(base)  # LoRA on every linear layer, one forward and backward pass
    assert math.isfinite(loss) and any(".attn.c_attn.lora_A" in n for n in grads)
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())

    copy = AutoModelForCausalLM.from_pretrained(dequantized_copy(base, tmp_path / "c"), dtype=torch.float32).eval()
    assert isinstance(copy.transformer.h[0].attn.c_attn, Conv1D)
    four_bit.train()  # bnb's dequantized-weight matmul, as in training (see tests/test_dequantize.py), no dropout
    for module in four_bit.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(copy(input_ids=ids).logits, four_bit(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
