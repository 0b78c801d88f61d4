"""Content fingerprints for cache keys: what truly determines a step's output.

Each step's key includes the versions of the libraries that compute it and the source of the project modules
that do (`STEP_CODE`), so an upgrade or a code change recomputes instead of silently reusing. The cache root is
not in the keys: entries live under it (store/entries.py), so a run with another cache root never sees them.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from finetune_flows.errors import DataError, ModelSourceError
from finetune_flows.packages import installed_version

_PROJECT = Path(__file__).resolve().parents[1]  # the finetune_flows package

# The libraries whose version can change each step's output.
STEP_LIBRARIES: dict[str, tuple[str, ...]] = {
    "prepare-dataset": ("transformers", "tokenizers", "datasets"),
    "quantize-base-model": ("torch", "transformers", "bitsandbytes", "accelerate"),
    "train-adapter": ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "liger-kernel", "flash-attn",
                      "flash-attn-3", "flash-attn-4"),
    "evaluate-adapter": ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "flash-attn", "flash-attn-3",
                         "flash-attn-4"),
    "evaluate-checkpoint": ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "flash-attn",
                            "flash-attn-3", "flash-attn-4"),  # the same worker: peft only for the adapter's row
    "merge-adapter": ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "safetensors"),
}

# The engine modules (paths under finetune_flows/) whose source can change each step's output. Modules not present
# (yet) are skipped, so a step's list may name a module another change is about to add.
STEP_CODE: dict[str, tuple[str, ...]] = {
    "prepare-dataset": ("data/dataset", "data/rows", "data/demo"),
    "quantize-base-model": ("models/quantize", "models/sources"),
    "train-adapter": ("training/train", "training/worker", "data/packing", "models/attention", "training/planner",
                      "training/distributed", "training/sharding", "training/compiling", "models/dequantize",
                      "models/float8", "models/shapes",
                      "config/plan", "training/lean", "training/loss_chunks"),
    "evaluate-adapter": ("evaluation/evaluate", "evaluation/worker", "evaluation/metrics", "evaluation/generation",
                         "evaluation/static_engine", "models/dequantize", "data/packing", "models/kernels",
                         "models/shapes"),
    "evaluate-checkpoint": ("evaluation/evaluate", "evaluation/worker", "evaluation/metrics", "evaluation/generation",
                            "evaluation/static_engine", "models/dequantize", "data/packing", "models/kernels",
                            "models/shapes"),
    "merge-adapter": ("export/merge", "models/dequantize"),
}

# Where each step's output is computed: these modules and every engine module they import, directly or not, are
# either in the step's STEP_CODE or named below (tests/test_cache_keys.py), so a module that starts to shape an output
# cannot stay out of the key unnoticed.
STEP_ENTRIES: dict[str, tuple[str, ...]] = {
    "prepare-dataset": ("data/dataset",),
    "quantize-base-model": ("models/quantize",),
    "train-adapter": ("training/train", "training/worker"),
    "evaluate-adapter": ("evaluation/evaluate", "evaluation/worker"),
    "evaluate-checkpoint": ("evaluation/evaluate", "evaluation/worker"),
    "merge-adapter": ("export/merge",),
}
# How the work runs and is recorded, not what it computes: processes, locks, logs, events, timing, atomic writes, the
# store, the config's schema and checks (its values are in the keys), the installed versions' lookup (the versions are
# in the keys), and the plan's resolution (the resolved device, precision, attention backends and strategy are in the
# keys; the training planner is in its step's code), and a GGUF's header check (it refuses files, converts none).
PLUMBING_CODE = frozenset({
    "errors", "files", "logs", "packages", "orchestration/concurrency", "reporting/progress", "reporting/tracking",
    "runtime/environment", "runtime/forkserver", "runtime/gpus", "runtime/launcher", "runtime/lifecycle",
    "runtime/policy", "runtime/processes", "store/entries", "store/fingerprint", "training/attempts",
    "training/checkpoints", "training/clock", "training/profiling", "config/preflight", "config/schema",
    "config/plan", "training/planner", "training/sharding", "models/backends", "models/shapes", "runtime/ray_cluster",
    "models/gguf_header",
})
# Per step, imported code whose effect reaches the key through an input's fingerprint (the dataset's, the base
# model's, the adapter's files), or that the step uses for something else than its output.
_INPUTS = ("data/dataset", "data/rows", "data/demo", "models/sources", "models/quantize")
CODE_KEYED_BY_INPUTS: dict[str, frozenset[str]] = {
    # the plan's attention probe (config/plan -> models/backends -> models/shapes) reads the model's config
    "prepare-dataset": frozenset({"models/sources"}),
    "quantize-base-model": frozenset({"models/sources", "data/demo"}),
    # models/backends' probe generates with evaluation/generation, and only checks hardware.kernels
    "train-adapter": frozenset({*_INPUTS, "evaluation/generation", "models/kernels"}),
    # the evaluation reads the name of export/merge's record, to leave it out of a checkpoint's key
    "evaluate-adapter": frozenset({*_INPUTS, "export/merge"}),
    "evaluate-checkpoint": frozenset({*_INPUTS, "export/merge"}),
    "merge-adapter": frozenset(_INPUTS),
}


def hash_bytes_of(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.name).encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def hash_tree(root: Path, suffixes: tuple[str, ...] | None = None, exclude: tuple[str, ...] = ()) -> str:
    """Hash every file under root (names and bytes), optionally only those with given suffixes, less the files
    named in `exclude`."""
    files = sorted(p for p in Path(root).rglob("*") if p.is_file() and (suffixes is None or p.suffix in suffixes)
                   and p.name not in exclude)
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(root)).encode())
        h.update(hash_bytes_of([p]).encode())
    return h.hexdigest()


def code_version(*modules: str) -> str:
    """Hash of the source of the given engine modules (`"data/dataset"`) that exist, so a code change invalidates
    what it affects."""
    return hash_bytes_of([p for p in (_PROJECT / f"{m}.py" for m in sorted(modules)) if p.is_file()])[:16]


def step_versions(step: str) -> dict[str, Any]:
    """The code and library versions that go into a step's key."""
    return {"code": code_version(*STEP_CODE[step]),
            "libraries": {d: installed_version(d) for d in STEP_LIBRARIES[step]}}


def resolve_hub_revision(repo_id: str, revision: str | None, repo_type: str) -> str:
    """The commit a Hub reference (branch, tag or None = main) points to now: asked of the Hub, or, offline,
    read from the local Hub cache (what that reference pointed to when it was downloaded)."""
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    try:
        from huggingface_hub import HfApi

        return HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision).sha
    except Exception as exc:
        from huggingface_hub.constants import HF_HUB_CACHE

        cached = cached_hub_commit(repo_id, revision, repo_type)
        if cached:
            return cached
        raise LookupError(f"cannot resolve {repo_type} {repo_id}@{revision or 'main'} to a commit: not reachable "
                          f"({type(exc).__name__}) and not in the local Hub cache {HF_HUB_CACHE}") from None


def cached_hub_commit(repo_id: str, revision: str | None, repo_type: str) -> str | None:
    """The commit of a Hub reference (a branch, tag or None = main, or a commit) in the local Hub cache: what the
    reference pointed to when it was downloaded; None where the cache does not hold it."""
    from huggingface_hub.constants import HF_HUB_CACHE

    repo = Path(HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision if (repo / "snapshots" / revision).is_dir() else None
    ref = repo / "refs" / (revision or "main")
    return ref.read_text().strip() if ref.is_file() else None


def is_hub_model(source: str) -> bool:
    """A model.source that names a Hub repository: no built-in or generated model, no existing path."""
    return not source.startswith(("builtin:", "generated:")) and not Path(source).expanduser().exists()


def uncached_hub_sources(cfg) -> list[tuple[str, str, str, str | None, str]]:
    """The run's Hub sources the local Hub cache does not hold, as (key, source, repo id, revision, repo type): a
    model.source that is no built-in, generated model or existing path, and each `hub:` data source."""
    wanted = []
    src = cfg.model.source
    if is_hub_model(src):
        wanted.append(("model.source", src, src, cfg.model.revision, "model"))
    for key, source in (("data.source", cfg.data.source), ("data.eval_source", cfg.data.eval_source)):
        if source and source.startswith("hub:"):
            wanted.append((key, source, source[4:], cfg.data.hub_revision, "dataset"))
    return [w for w in wanted if cached_hub_commit(*w[2:]) is None]


def pin_hub_revisions(cfg):
    """The config with Hub model/dataset revisions pinned to commits, so cache keys see upstream changes and
    config.resolved.yaml records exactly what was read. Local and built-in sources are returned unchanged."""
    model, data = cfg.model, cfg.data
    source = model.source
    if not (source.startswith(("builtin:", "generated:", ".", "/", "~")) or Path(source).expanduser().exists()):
        try:
            model = model.model_copy(update={"revision": resolve_hub_revision(model.source, model.revision, "model")})
        except LookupError as exc:
            raise ModelSourceError(f"model.source={cfg.model.source}: {exc}") from None
    if data.source.startswith("hub:"):
        try:
            data = data.model_copy(update={"hub_revision": resolve_hub_revision(data.source[4:], data.hub_revision,
                                                                                "dataset")})
        except LookupError as exc:
            raise DataError(f"data.source={data.source}: {exc}") from None
    return cfg.model_copy(update={"model": model, "data": data})


def combine(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
