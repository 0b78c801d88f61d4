"""Hub kernels for model layers (`hardware.kernels`), also on hosts without the Hub.

`hardware.kernels` maps a layer name that transformers registers for kernels (`RMSNorm`, `SiLU`,
`rotary_pos_emb`, ... : the names in `@use_kernel_forward_from_hub(...)`) to a kernel repo and the layer class
in it: `org/repo:LayerClass` (a Hub kernel repo) or `/path/to/repo:LayerClass` (a local kernel repo directory).
A Hub repo id is looked up in `LOCAL_KERNELS` first (`org/repo=/path:org/other=/path2`, the `kernels`
package's own convention), so air-gapped GPU hosts use local copies; only an id found nowhere needs the Hub.

Every mapped kernel is loaded before anything is replaced; one that fails to load is a warning naming it and
its layer keeps the stock implementation, so numerics never change silently. `apply_kernels` reports which
modules were kernelized; the environment probe reports which mapped kernels load (`check_kernels`).
transformers' own `use_kernels`/`KernelConfig` path refuses CPU devices and loads repos eagerly (an error,
not a warning, when one fails), so this module drives the `kernels` package directly with the same mapping.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path


def local_kernel_repo(repo_id: str) -> Path | None:
    """The local directory LOCAL_KERNELS gives for a Hub kernel repo id, if any."""
    for entry in filter(None, os.environ.get("LOCAL_KERNELS", "").split(":")):
        name, _, path = entry.partition("=")
        if name == repo_id.split("@")[0] and path:
            return Path(path).expanduser()
    return None


def repository(spec: str):
    """The `kernels` layer repository for `org/repo[@revision]:LayerClass` or `/local/repo:LayerClass`."""
    from kernels import LayerRepository, LocalLayerRepository

    repo, sep, layer_class = spec.rpartition(":")
    if not sep or not repo or not layer_class:
        raise ValueError(f"kernel `{spec}`: expected `org/repo:LayerClass` or `/path/to/repo:LayerClass`")
    path = Path(repo).expanduser()
    if repo.startswith(("/", ".", "~")):
        return LocalLayerRepository(path, layer_name=layer_class)
    local = local_kernel_repo(repo)
    if local is not None:
        return LocalLayerRepository(local, layer_name=layer_class)
    repo_id, _, revision = repo.partition("@")
    return LayerRepository(repo_id=repo_id, layer_name=layer_class, **({"revision": revision} if revision
                                                                       else {"version": 1}))


def load_kernels(mapping: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """(layer name -> loaded repository, layer name -> why it could not be loaded)."""
    loaded, failed = {}, {}
    for layer, spec in mapping.items():
        try:
            repo = repository(spec)
            repo.load()  # import it now, so a broken kernel is reported here and never half-applied
            loaded[layer] = repo
        except Exception as exc:  # any failure: keep the stock layer, say which kernel and why
            failed[layer] = f"{spec}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return loaded, failed


def check_kernels(mapping: dict[str, str]) -> dict[str, str]:
    """For the environment report: layer name -> "loads (<repo>)" or why its kernel cannot be used."""
    if not mapping:
        return {}
    try:
        loaded, failed = load_kernels(mapping)
    except ImportError as exc:
        return {layer: f"kernels package unusable: {exc}" for layer in mapping}
    return {**{layer: f"loads ({mapping[layer]})" for layer in loaded},
            **{layer: f"cannot load, stock layer kept: {why}" for layer, why in failed.items()}}


def apply_kernels(model, mapping: dict[str, str], training: bool = False, logger=None) -> dict:
    """Replace the forward of every module whose registered layer name is mapped to a kernel that loads.

    Returns {"kernelized": {layer name: modules replaced}, "failed": {layer name: reason}}."""
    if not mapping:
        return {"kernelized": {}, "failed": {}}
    from kernels import KernelizeFallback, Mode, kernelize, use_kernel_mapping

    log = logger or logging.getLogger("finetune_flows")
    loaded, failed = load_kernels(mapping)
    for layer, why in failed.items():
        log.warning("kernel for %s not used, the stock layer stays: %s", layer, why)
    device = next(model.parameters()).device.type
    mode = Mode.TRAINING if training else Mode.INFERENCE
    quiet = logging.getLogger("kernels")
    level, quiet.level = quiet.level, logging.ERROR  # it warns once per unmapped layer, which is every other one
    try:
        with use_kernel_mapping({layer: {device: repo} for layer, repo in loaded.items()}, inherit_mapping=False):
            kernelize(model, mode=mode, device=device, use_fallback=KernelizeFallback.DEFAULT)
    finally:
        quiet.level = level
    kernelized: dict[str, int] = {}
    for module in model.modules():
        name = getattr(type(module), "kernel_layer_name", None)
        forward = getattr(module.forward, "__func__", None)
        if name in loaded and forward is not None and forward is not type(module).forward:
            kernelized[name] = kernelized.get(name, 0) + 1
    log.info("kernelized layers: %s", kernelized or "none")
    return {"kernelized": kernelized, "failed": failed}
