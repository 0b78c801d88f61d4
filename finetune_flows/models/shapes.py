"""A model's shape (hidden size, layers, attention heads, ...) as the planners use it, under Llama's key names, read
through transformers' config class: config.json's own keys differ by family (GPT-2: n_head, n_embd, n_layer) and a
multimodal config nests its language model's (Gemma-3: text_config). Cheap and offline: no weights, no download."""

from __future__ import annotations

from pathlib import Path

from finetune_flows.errors import ModelSourceError

# Where a config names its MLP width (GPT-2 and GPT-J: n_inner, Falcon: ffn_hidden_size, OPT: ffn_dim); with none
# set (GPT-2's n_inner: null) the MLP is 4x the hidden size.
MLP_WIDTH_KEYS = ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim")


def config_shape(config) -> dict:
    """The numbers the planners use, under Llama's key names, from a transformers config: read through the config
    class (its attribute_map gives GPT-2's n_head, n_embd, n_layer as num_attention_heads, hidden_size,
    num_hidden_layers) and of the language model of a multimodal config (Gemma-3's text_config), never from
    config.json's keys."""
    text = config.get_text_config()
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
               if getattr(text, k, None) is None]
    if missing:  # not a transformer decoder (Mamba, RWKV): nothing here can plan its memory or attention
        raise ModelSourceError(f"model type {config.model_type}: its config has no {', '.join(missing)}; only "
                               "transformer decoders (attention heads and hidden layers) can be fine-tuned here")
    hidden, heads = text.hidden_size, text.num_attention_heads
    mlp = next((width for key in MLP_WIDTH_KEYS if (width := getattr(text, key, None))), 4 * hidden)
    kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads
    tied = getattr(text, "tie_word_embeddings", None)
    return {"hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": text.num_hidden_layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": getattr(text, "head_dim", None) or hidden // heads, "vocab_size": text.vocab_size,
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False) if tied is None else tied)}


def checkpoint_shape(path: Path, trust_remote_code: bool = False) -> dict:
    """config_shape of a local checkpoint directory's config.json (no weights)."""
    from transformers import AutoConfig

    return config_shape(AutoConfig.from_pretrained(Path(path), trust_remote_code=trust_remote_code))
