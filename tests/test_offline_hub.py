"""A Hub model or dataset downloaded once runs offline: from the local Hub cache, pinned to the commit it recorded.

The cache here is the Hub's layout (`models--org--name/refs/main` naming a commit, `snapshots/<commit>/` its files)
holding a real tiny model, so the CLI case loads, quantizes, trains and evaluates it with HF_HUB_OFFLINE set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import child_env, tiny_overrides
from finetune_flows.config.schema import load_config
from finetune_flows.errors import EnvironmentMismatch
from finetune_flows.runtime.environment import EnvironmentReport, resolve_plan
from finetune_flows.runtime.gpus import selection_for

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "c" * 40


def hub_cache_entry(hub: Path, repo_type: str, repo: str, files: Path | None = None) -> Path:
    """`repo` in the Hub cache at `hub`, `main` pointing to COMMIT; its snapshot holds a copy of `files`."""
    entry = hub / f"{repo_type}s--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    if files is None:
        snapshot.mkdir(parents=True)
    else:
        shutil.copytree(files, snapshot)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(COMMIT)
    return snapshot


def offline_machine() -> EnvironmentReport:
    return EnvironmentReport(python="3.11", platform="linux", torch="2.13", cuda_available=False, cuda_version=None,
                             driver_version=None, gpus=[], versions={}, bitsandbytes_4bit="available",
                             attention={"eager": "available", "sdpa": "available"}, hub_reachable=False)


def test_the_environment_step_takes_hub_sources_from_the_local_cache_when_the_hub_is_unreachable(tmp_path,
                                                                                                  monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    hub_cache_entry(tmp_path, "model", "org/tiny")
    hub_cache_entry(tmp_path, "dataset", "org/tickets")
    env, cpu = offline_machine(), selection_for("auto", [])

    cached = load_config(None, ["model.source=org/tiny", "data.source=hub:org/tickets"])
    assert resolve_plan(cached, env, cpu).device == "cpu"
    pinned = load_config(None, ["model.source=org/tiny", f"model.revision={COMMIT}"])
    assert resolve_plan(pinned, env, cpu).device == "cpu"

    missing = load_config(None, ["model.source=org/tiny", "model.revision=v2", "data.source=hub:org/other"])
    with pytest.raises(EnvironmentMismatch) as refused:
        resolve_plan(missing, env, cpu)
    assert "model.source=org/tiny is neither a built-in, a generated model, an existing local path nor in the " \
           "local Hub cache, and the Hugging Face Hub is unreachable" in str(refused.value)
    assert "data.source=hub:org/other is not in the local Hub cache" in str(refused.value)


def test_a_hub_model_the_local_cache_holds_trains_and_evaluates_offline(tmp_path):
    from finetune_flows.models.sources import _materialize_generated

    built = tmp_path / "built"
    built.mkdir()
    _materialize_generated("tiny-llama", built)
    hub = tmp_path / "hub"
    hub_cache_entry(hub, "model", "org/tiny", built)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HF_"))}
    env = child_env(env, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                    HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    runs = tmp_path / "runs"
    overrides = tiny_overrides(tmp_path / "cache", runs, **{"model.source": "org/tiny"})
    done = subprocess.run([sys.executable, "flows/finetune.py", *[a for o in overrides for a in ("--set", o)]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = runs.iterdir()
    resolved = yaml.safe_load((run / "config.resolved.yaml").read_text())
    assert resolved["model"] == resolved["model"] | {"source": "org/tiny", "revision": COMMIT}
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert (run / "eval.json").is_file()


def test_a_hub_model_the_local_cache_holds_only_in_part_is_one_message_before_any_server(tmp_path):
    """Config and tokenizer cached (what AutoConfig/AutoTokenizer fetch), no weights: the preflight passed it
    offline, then the quantize worker failed twice on "does not appear to have a file named model.safetensors"
    after a server had started."""
    from finetune_flows.models.sources import _materialize_generated

    built = tmp_path / "built"
    built.mkdir()
    _materialize_generated("tiny-llama", built)
    (built / "model.safetensors").unlink()
    hub = tmp_path / "hub"
    snapshot = hub_cache_entry(hub, "model", "org/tiny", built)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HF_"))}
    env = child_env(env, PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
                    HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    overrides = tiny_overrides(tmp_path / "cache", tmp_path / "runs", **{"model.source": "org/tiny"})
    done = subprocess.run([sys.executable, "flows/finetune.py", *[a for o in overrides for a in ("--set", o)]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("error: "), done.stderr[-3000:]
    assert (f"model.source=org/tiny: the local Hub cache holds no weights (*.safetensors/*.bin) of "
            f"org/tiny@{COMMIT[:12]} ({snapshot}), only part of it, and HF_HUB_OFFLINE is set") in done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.glob("prefect-home/*.db"))
    assert not (tmp_path / "runs").exists()
