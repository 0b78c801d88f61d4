"""Everything about a run that can be checked without loading a model: in seconds, before a Prefect server starts.

The CLI runs it first, so bad input is one message and exit status 2, with no traceback and no run directory left
behind; a flow runs it first thing unless the CLI did in its process (a deployment run has no CLI), so it runs
once per run. Checked: the config's combinations (its keys were validated when the typed config was built), the
model source (names and files, no weights; custom code only when trusted), every row of the data files (an
encoding error names its line) and their split (rows to train on, held-out rows left once copies of training
prompts are removed), the GPUs through NVML (ids, CUDA_VISIBLE_DEVICES, MIG; no torch, no CUDA context), what the
attention backend needs from the machine, the optimizer name, the experiment trackers (installed, an MLflow server
answering), and that the run and cache directories (and $FINETUNE_FLOWS_PROBE_DIR, where set) can be created
and the store's directories under them that exist can be written (check_directories).
LoRA target modules are checked against the model's module names, the model built on the meta device from its
config (no weights): the source's, where one can be read without a download, and again before training launches.
Where the tokenizer can be had without the Hub, the first rows of each data file go through it and its chat
template (a row the template refuses; data none of whose rows fit data.max_length)."""

from __future__ import annotations

import ast
import importlib.util
import os
from functools import lru_cache
from pathlib import Path

from finetune_flows.config.schema import FinetuneConfig, check_config
from finetune_flows.data.dataset import check_rows_tokenize, check_split_fits, normalize, read_rows, split
from finetune_flows.data.rows import row_names
from finetune_flows.errors import (ConfigError, DataError, EnvironmentMismatch, ModelSourceError,
                                   UserInputError, first_line)
from finetune_flows.runtime.gpus import GpuInfo, choose_gpu_ids, read_inventory
from finetune_flows.models.shapes import config_shape
from finetune_flows.models.sources import (check_causal_lm, check_model_source, check_weight_files, hub_snapshot,
                                           model_config, tokenizer_without_download)
from finetune_flows.packages import installed_version
from finetune_flows.store.entries import LOCKS, VERIFIED
from finetune_flows.store.fingerprint import cached_hub_commit, is_hub_model, uncached_hub_sources
from finetune_flows.training.compiling import COSTS
from finetune_flows.runtime.policy import allowed_config
from finetune_flows.runtime.ray_cluster import ray_problems
from finetune_flows.reporting.tracking import tracking_problems
from finetune_flows.runtime.environment import (PROBE_DIR_ENV, PROBES, cpu_half_precision_problems, hub_reachable,
                                                probe_dir)

FLASH_PACKAGES = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn-3",
                  "flash_attention_4": "flash-attn-4"}


_checked_here: set[str] = set()  # fingerprints of the configs this process's CLI checked before their run


def preflight(cfg: FinetuneConfig, inventory: list[GpuInfo] | None = None) -> FinetuneConfig:
    """The config once checked, or a UserInputError naming every problem found (the data's first). The worker
    host's policy (finetune_flows/runtime/policy.py) is applied first, so a refused run reads and writes nothing.
    A config the CLI checked in this process (`cli_preflight`) is not checked again by its flow. `inventory`: the
    flow run's reading of the GPUs (read here where the caller has none)."""
    if cfg.fingerprint() in _checked_here:
        return cfg
    return _check(cfg, inventory)


def cli_preflight(cfg: FinetuneConfig) -> FinetuneConfig:
    """The CLI's check, before a Prefect server starts; the flow this process then runs on it skips its own."""
    cfg = _check(cfg)
    _checked_here.add(cfg.fingerprint())
    return cfg


def without_tracking(cfg: FinetuneConfig) -> FinetuneConfig:
    """The config of an evaluate or export run, which logs to no tracker: the training's tracking settings dropped,
    so an MLflow server that is down does not stop it."""
    return cfg.model_copy(update={"tracking": type(cfg.tracking)()})


def _check(cfg: FinetuneConfig, inventory: list[GpuInfo] | None = None) -> FinetuneConfig:
    cfg = allowed_config(check_config(cfg))
    check_model_source(cfg.model.source, cfg.model.trust_remote_code)
    examples, splits = check_data(cfg)
    check_lora_targets_of_source(cfg)
    check_directories(cfg)
    check_tokens(cfg, examples, splits)
    problems = (optimizer_problems(cfg) + machine_problems(cfg, inventory) + tracking_problems(cfg)
                + hub_problems(cfg) + ray_problems(cfg))
    if problems:
        raise EnvironmentMismatch(problems, "config vs this machine")
    return cfg


# ---------------------------------------------------------------- data


def check_utf8(path: Path) -> None:
    """A text data file that is not UTF-8, reported with the line and column of the first bad byte."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(f"{path} line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column}); "
                        "save the file as UTF-8") from None


def check_data(cfg: FinetuneConfig) -> tuple[dict[str, tuple[list, list[str]]], tuple[list, list] | None]:
    """Every row of the training (and held-out) data, as the dataset step will read it, and its split: enough rows
    to train on and held-out rows left once the copies of training prompts are removed. Returns, for
    `check_tokens`, each local source's examples and where each row is, and the split (None with a Hub source)."""
    d = cfg.data
    formats, examples = {}, {}
    for source in filter(None, (d.source, d.eval_source)):
        if source.startswith("hub:"):  # needs the Hub; the environment step checks that it is reachable
            continue
        path = Path(source).expanduser()
        if not source.startswith("builtin:") and path.is_file() and path.suffix.lower() != ".parquet":
            check_utf8(path)
        rows = read_rows(source, d)
        formats[source], normalized = normalize(rows, d, source)
        examples[source] = (normalized, row_names(rows))
    if d.eval_source in formats and len(set(formats.values())) > 1:
        raise DataError(f"{d.eval_source} is {formats[d.eval_source]} format but {d.source} is {formats[d.source]}")
    if d.source in examples and (d.eval_source is None or d.eval_source in examples):
        train, held_out, *_ = split(d, examples[d.source][0], examples[d.eval_source][0] if d.eval_source else None)
        return examples, (train, held_out)
    return examples, None


def check_tokens(cfg: FinetuneConfig, examples: dict[str, tuple[list, list[str]]],
                 splits: tuple[list, list] | None) -> None:
    """The rows through the model's tokenizer and chat template, where the tokenizer can be had without the Hub:
    a template that refuses a row, or a split none of whose rows fit data.max_length, is said before a server
    starts (the split only where every row was tokenized: PREFLIGHT_ROWS)."""
    if not examples:
        return
    tokenizer = tokenizer_without_download(cfg.model.source, cfg.cache_root, cfg.model.revision,
                                           cfg.model.trust_remote_code)
    if tokenizer is None:
        return
    fits: dict[int, int] | None = {}
    for source, (normalized, names) in examples.items():
        fit = check_rows_tokenize(tokenizer, normalized, names, source, cfg.data)
        fits = None if fits is None or fit is None else fits | fit
    if fits is not None and splits is not None:
        check_split_fits(cfg.data, *splits, fits)
        check_micro_batch_holds_a_row(cfg, max(fits.get(id(ex), 0) for ex in splits[0]))


def check_micro_batch_holds_a_row(cfg: FinetuneConfig, longest: int) -> None:
    """A packed micro-batch of train.micro_batch_tokens must hold the longest training row (`longest` tokens): the
    training plan refuses it otherwise, once the base is quantized."""
    tokens = cfg.train.micro_batch_tokens
    if cfg.train.packing and tokens is not None and tokens < longest:
        raise ConfigError([f"train.micro_batch_tokens={tokens} is less than the longest training row ({longest} "
                           f"tokens, data.max_length={cfg.data.max_length}): a packed micro-batch holds whole rows; "
                           f"set at least {longest}, or lower data.max_length"], "config vs data")


def hub_problems(cfg: FinetuneConfig) -> list[str]:
    """A Hub model or dataset that neither the local Hub cache holds nor the Hub can give (offline, unreachable):
    said here, not by the flow's first step after a server has started. Asks the Hub only where the cache lacks it."""
    missing, incomplete = uncached_hub_sources(cfg), incomplete_cached_model(cfg)
    if not (missing or incomplete) or hub_reachable():
        return []
    from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE

    why = "HF_HUB_OFFLINE is set" if HF_HUB_OFFLINE else "the Hugging Face Hub is unreachable"
    problems = [f"{key}={source}: " + (f"no local directory {Path(source).expanduser().absolute()}, and as a Hub id "
                                       if kind == "model" else "") +
                f"{repo}@{revision or 'main'} is not in the local Hub cache ({HF_HUB_CACHE}) and {why}"
                for key, source, repo, revision, kind in missing]
    return problems + ([f"{incomplete}, and {why}"] if incomplete else [])


def incomplete_cached_model(cfg: FinetuneConfig) -> str | None:
    """What a Hub model's snapshot in the local Hub cache lacks (a download that stopped, or only the config and
    tokenizer fetched, as AutoConfig/AutoTokenizer do), or None: offline the quantize step would fail on it."""
    from huggingface_hub.constants import HF_HUB_CACHE

    source = cfg.model.source
    commit = cached_hub_commit(source, cfg.model.revision, "model") if is_hub_model(source) else None
    if commit is None:
        return None
    snapshot = Path(HF_HUB_CACHE) / f"models--{source.replace('/', '--')}" / "snapshots" / commit
    try:
        check_weight_files(source, snapshot)
    except ModelSourceError as exc:
        return f"{exc} (in the local Hub cache, {snapshot})"
    if not any(snapshot.glob("*.safetensors")) and not any(snapshot.glob("*.bin")):
        return (f"model.source={source}: the local Hub cache holds no weights (*.safetensors/*.bin) of "
                f"{source}@{commit[:12]} ({snapshot}), only part of it")
    return None


# ---------------------------------------------------------------- directories


def _first_existing(path: Path) -> Path:
    while not path.exists() and not path.is_symlink() and path != path.parent:
        path = path.parent
    return path


# The store's directories under the cache root that a run may write: the kinds of entry (finetune_flows/store/
# entries.py and the callers of Entry), their locks and verified records, and torch's compile caches.
STORE_DIRS = (LOCKS, VERIFIED, "models", "tokenizers", "datasets", "quantized", "adapters", "evals", "merged",
              "dequantized", PROBES, "attention-probes", COSTS, "compile")
PROBE_DIRS = (LOCKS, VERIFIED, PROBES)  # what the probes write under $FINETUNE_FLOWS_PROBE_DIR


def directory_problem(path: Path) -> str | None:
    """Why a run cannot write in the directory `path` (which exists, or is a link), or None."""
    if path.is_symlink() and not path.exists():
        return f"{path} is a link to {os.readlink(path)}, which does not exist"
    if path.is_symlink() and not path.is_dir():
        return f"{path} is a link to {os.readlink(path)}, which is a file, not a directory"
    if not path.is_dir():
        return f"{path} is a file, so no directory can be created there"
    try:
        fs = os.statvfs(path)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if fs.f_flag & os.ST_RDONLY:
        return f"{path} is on a read-only file system"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    if (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) == 0:  # root may use the blocks reserved for it
        return f"{path} is on a full file system (no space left)"
    return None


def check_directories(cfg: FinetuneConfig) -> None:
    """The run and cache directories (and the probe directory) can be written: each, or its first existing parent,
    and every store directory under the cache that exists already (a file, a dangling link, a read-only or full
    file system there would otherwise fail a step deep inside, after a model was loaded). Creates nothing."""
    cache_key = "FINETUNE_FLOWS_CACHE" if os.environ.get("FINETUNE_FLOWS_CACHE") else "run.cache_dir"
    places = [("run.output_dir", Path(cfg.run.output_dir).expanduser(), ()), (cache_key, cfg.cache_root, STORE_DIRS)]
    if os.environ.get(PROBE_DIR_ENV):  # the host's directory of machine probes, where the operator set one
        places.append((PROBE_DIR_ENV, probe_dir(cfg.cache_root), PROBE_DIRS))
    for key, path, subdirs in places:
        other = f"{key} (or FINETUNE_FLOWS_CACHE)" if key == "run.cache_dir" else key
        fix = f"; fix that, or set {other} to another directory"
        existing = _first_existing(path.absolute())
        if problem := directory_problem(existing):
            raise UserInputError(f"{key}={path}: {problem}{fix}")
        for name in subdirs if existing == path.absolute() else ():
            sub = existing / name
            if (sub.exists() or sub.is_symlink()) and (problem := directory_problem(sub)):
                raise UserInputError(f"{key}={path}: {problem}{fix}")


# ---------------------------------------------------------------- optimizer, GPUs, attention


@lru_cache(maxsize=1)
def optimizer_names() -> frozenset[str] | None:
    """transformers' OptimizerNames, read from its source (importing transformers.training_args takes seconds)."""
    spec = importlib.util.find_spec("transformers")
    try:
        tree = ast.parse((Path(spec.origin).parent / "training_args.py").read_text())
    except (AttributeError, TypeError, OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "OptimizerNames":
            return frozenset(s.value.value for s in node.body if isinstance(s, ast.Assign)
                             and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))
    return None


def optimizer_problems(cfg: FinetuneConfig) -> list[str]:
    names = optimizer_names()
    if names is None or cfg.train.optimizer in names:
        return []
    close = sorted(n for n in names if cfg.train.optimizer.split("_")[0] in n)[:6]
    return [f"train.optimizer={cfg.train.optimizer} is not an optimizer transformers knows"
            + (f" (similar: {', '.join(close)})" if close else f"; known: {', '.join(sorted(names))}")]


def machine_problems(cfg: FinetuneConfig, inventory: list[GpuInfo] | None = None) -> list[str]:
    """GPU ids against NVML's inventory, float16 on the CPU, and what the attention backend needs (the environment
    step, which loads torch, checks the rest)."""
    problems: list[str] = []
    try:
        reading = read_inventory() if inventory is None else inventory
        ids: list[int] | None = choose_gpu_ids(cfg.hardware.gpus, reading)
    except ConfigError as exc:
        problems, ids = exc.problems, None
    if ids == []:  # the CPU
        problems += cpu_half_precision_problems(cfg)
    for key, attn in cfg.attention_settings().items():
        if attn in FLASH_PACKAGES:
            if ids == []:
                problems.append(f"{key}={attn} needs a CUDA GPU, but this run uses the CPU "
                                f"(hardware.gpus={cfg.hardware.gpus})")
            if installed_version(FLASH_PACKAGES[attn]) is None:
                problems.append(f"{key}={attn} needs the {FLASH_PACKAGES[attn]} package, which is not installed")
    return problems


# ---------------------------------------------------------------- LoRA targets (the model's module names)


def check_lora_targets(model_dir: Path, targets: list[str] | str, trust_remote_code: bool = False) -> None:
    """Every `lora.target_modules` entry must name modules of the model in `model_dir` (its config.json)."""
    if targets == "all-linear":
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    lora_target_problems(_meta_model(config, trust_remote_code), targets)


def check_lora_targets_of_source(cfg: FinetuneConfig) -> None:
    """The model source built on the meta device from its config, before anything is loaded or generated, and
    check_lora_targets on it; its shape read as the planners read it, and an attention dropout packed training
    cannot apply refused. A checkpoint's config.json (a local directory's, a Hub id's in the local Hub cache) is
    built even with all-linear: one transformers cannot build as a causal LM (an unknown model_type), or that is no
    decoder-only causal LM (BERT, BART: check_causal_lm), is one message here, not a traceback from a worker after a
    server started; its safetensors headers are checked against that model (check_weight_shapes; a Hub snapshot's
    also for being readable, as check_model_source checks a local directory's). A GGUF's metadata (seconds to read)
    and a generated shape (ours) only to check listed targets; where only a download would give the config (a Hub id
    not cached here), the training step checks it instead."""
    source, listed = cfg.model.source, cfg.lora.target_modules != "all-linear"
    if not listed and (source.startswith(("builtin:", "generated:")) or Path(source).expanduser().is_file()):
        return
    remote = cfg.model.trust_remote_code
    try:
        config = model_config(source, cfg.model.revision, remote)
    except Exception as exc:  # what the quantize worker would have met, after a server had started
        raise _unbuildable(source, exc) from None
    if config is None:
        return
    check_causal_lm(source, config)  # before the meta build: transformers builds BERT as a causal LM
    readable_config_shape(source, config)  # attention heads and layers the planners can read
    check_attention_dropout(cfg, config)
    packed = hasattr(config, "quantization_config")  # a quantized checkpoint: its tensors have packed shapes
    try:
        model = _meta_model(config, remote)
    except Exception as exc:
        raise _unbuildable(source, exc) from None
    path = Path(source).expanduser()
    if path.is_dir() and not packed:
        check_weight_shapes(source, path, model)
    if (snapshot := hub_snapshot(source, cfg.model.revision)) is not None:
        try:  # a shard the snapshot lacks is downloaded, or named by hub_problems where the Hub is out of reach
            check_weight_files(source, snapshot, shards=False)
            if not packed:
                check_weight_shapes(source, snapshot, model)
        except ModelSourceError as exc:
            raise ModelSourceError(f"{exc} (in the local Hub cache, {snapshot})") from None
    if listed:
        lora_target_problems(model, cfg.lora.target_modules)


def _unbuildable(source: str, exc: Exception) -> ModelSourceError:
    return ModelSourceError(f"model.source={source}: transformers cannot build a causal language model from its "
                            f"config ({type(exc).__name__}: {first_line(exc)})")


def readable_config_shape(source: str, config) -> dict:
    """config_shape of the source's config, or one message naming the source where it has no transformer shape."""
    try:
        return config_shape(config)
    except ModelSourceError as exc:
        raise ModelSourceError(f"model.source={source}: {exc}") from None


# Where configs name their attention dropout (GPT-2 and GPT-J: attn_pdrop, BERT-style: attention_probs_dropout_prob)
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def check_attention_dropout(cfg: FinetuneConfig, config) -> None:
    """Packed training's variable-length attention kernels have no dropout, so a model whose config sets one (GPT-2:
    attn_pdrop=0.1) failed at its first training step, after a server started and the model was quantized."""
    if not cfg.train.packing:
        return
    text = config.get_text_config()
    for key in ATTENTION_DROPOUT_KEYS:
        rate = getattr(text, key, None)
        if isinstance(rate, (int, float)) and rate > 0:
            raise ModelSourceError(f"model.source={cfg.model.source}: its config sets {key}={rate:g} (attention "
                                   "dropout), which packed training cannot apply; set train.packing=false (padded "
                                   f"batches apply it), or {key} to 0 in its config.json")


def check_weight_shapes(source: str, path: Path, model) -> None:
    """Each safetensors tensor of a local checkpoint (or of a Hub id's snapshot in the local Hub cache) against the
    tensor of that name in the model its config.json builds (`model`, on the meta device; the headers only are
    read): a config.json of another size of the model loads as 4-bit without a word from transformers (bitsandbytes
    packs the tensors as they are) and trains on nonsense. Names the model does not have are left to transformers
    (it renames some)."""
    from safetensors import safe_open

    expected = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    wrong = []
    for weights in sorted(path.glob("*.safetensors")):
        with safe_open(weights, "pt") as tensors:
            wrong += [f"{key} is {shape} in {weights.name}, {expected[key]} in the model" for key in tensors.keys()
                      if key in expected and (shape := list(tensors.get_slice(key).get_shape())) != expected[key]]
    if wrong:
        raise ModelSourceError(f"model.source={source}: {len(wrong)} weight(s) do not have the shape its config.json "
                               f"gives, e.g. {wrong[0]}; is config.json this checkpoint's?")


def lora_target_problems(model, targets: list[str]) -> None:
    """Each target must name modules of `model` (built on the meta device: no weights, no memory), as PEFT matches
    them (the full name or its last parts)."""
    import torch

    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        from transformers.pytorch_utils import Conv1D

        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, (torch.nn.Linear, Conv1D))})  # GPT-2's linear layers are Conv1D
        raise ConfigError([f"lora.target_modules: the model has no module named {', '.join(missing)}; its linear "
                           f"layers are {', '.join(linear)} (or use all-linear)"], "config vs model")


def _meta_model(config, trust_remote_code: bool = False):
    """The model `config` describes, built on the meta device: its modules and shapes, no weights, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    if hasattr(config, "quantization_config"):  # a 4-bit checkpoint's module names are the plain model's
        del config.quantization_config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def check_adapter_fits(adapter_dir: Path, cfg: FinetuneConfig, named_by: str = "") -> None:
    """An adapter's LoRA weights must fit the layers of the model the config names: evaluated or merged with a
    config for another model, it would fail only once that model is quantized and loaded (a size mismatch per
    weight, and a retry). Skipped where only a download would give the model's config."""
    from safetensors import safe_open

    weights = adapter_dir / "adapter_model.safetensors"  # named_by: where the adapter comes from, if not given
    checked = (str(weights.resolve()), cfg.model.source, cfg.model.revision)
    if checked in _adapters_checked_here or not weights.is_file():
        return
    config = model_config(cfg.model.source, cfg.model.revision, cfg.model.trust_remote_code)
    if config is None:
        return
    modules = dict(_meta_model(config, cfg.model.trust_remote_code).named_modules())
    misfits = []
    with safe_open(weights, "pt") as tensors:
        for key in tensors.keys():
            name, _, kind = key.partition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                continue
            name = name.removeprefix("base_model.model.")
            module, shape = modules.get(name), tensors.get_slice(key).get_shape()
            if module is None:
                misfits.append(f"{key}: the model has no module {name}")
            elif kind == "A.weight" and shape[1] != getattr(module, "in_features", shape[1]):
                misfits.append(f"{key}: {shape[1]} inputs, the model's layer has {module.in_features}")
            elif kind == "B.weight" and shape[0] != getattr(module, "out_features", shape[0]):
                misfits.append(f"{key}: {shape[0]} outputs, the model's layer has {module.out_features}")
    if misfits:
        raise ConfigError([f"the adapter {adapter_dir}{named_by} does not fit model.source={cfg.model.source}: "
                           f"{len(misfits)} LoRA weight(s) do not match its layers, e.g. {misfits[0]}; was it "
                           "trained on another model? (without --config the run's own config.resolved.yaml is used)"],
                          "adapter vs model")
    _adapters_checked_here.add(checked)  # the CLI checked it: the flow it then runs does not build the model again


_adapters_checked_here: set[tuple] = set()

SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads")


def check_merged_fits(merged_dir: Path, cfg: FinetuneConfig) -> None:
    """A merged checkpoint is scored beside the model the config names, so it must have that model's shape: with
    another model's config the `base` row was that other model's, without a word. Read from the two config files
    (no weights); skipped where only a download would give the model's config."""
    from transformers import AutoConfig

    base = model_config(cfg.model.source, cfg.model.revision, cfg.model.trust_remote_code)
    try:
        merged = AutoConfig.from_pretrained(merged_dir, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError):
        return  # the evaluation worker says what it cannot read
    if base is None:
        return
    merged, base = merged.get_text_config(), base.get_text_config()
    differ = [f"{key} {getattr(merged, key)} (the model's: {getattr(base, key)})" for key in SHAPE_KEYS
              if None not in (getattr(merged, key, None), getattr(base, key, None))
              and getattr(merged, key) != getattr(base, key)]
    if differ:
        raise ConfigError([f"the merged checkpoint {merged_dir} is not made from model.source={cfg.model.source}: "
                           f"{', '.join(differ)}; was it made from another model? (without --config the config of "
                           "the run that made it is used)"], "merged checkpoint vs model")
