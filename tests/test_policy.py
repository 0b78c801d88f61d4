"""The worker policy on its own (no server): what it refuses, how paths are resolved, and secrets.

tests/test_policy_deployments.py checks the same refusals through real deployment runs.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import yaml

import finetune_flows.runtime.policy as policy_mod
from finetune_flows.config.schema import load_config
from finetune_flows.runtime.policy import (
    POLICY_ENV, Policy, PolicyError, check_adapter_path, checked_config, config_problems, current_policy,
    read_policy, strip_secrets,
)


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A worker host layout and its policy file (roots relative to the file, as `make worker` may write them)."""
    for d in ("data", "runs", "cache", "configs", "outside"):
        (tmp_path / d).mkdir()
    (tmp_path / "data" / "ok.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "outside" / "secret.jsonl").write_text('{"prompt": "password", "response": "hunter2"}\n')
    (tmp_path / "configs" / "run.yaml").write_text("run:\n  name: x\n")
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"data_roots": ["data"], "output_roots": ["runs"], "cache_roots": ["cache"],
                                    "config_roots": ["configs"]}))
    monkeypatch.setenv(POLICY_ENV, str(path))
    monkeypatch.delenv("FINETUNE_FLOWS_CACHE", raising=False)
    monkeypatch.setattr(policy_mod._Decision, "secrets_allowed", None)
    saved = dict(os.environ)  # a refused-secrets run strips them from this process too: put them back after
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)


def allowed(host: Path, **extra: str) -> list[str]:
    base = {"data.source": str(host / "data" / "ok.jsonl"), "run.output_dir": str(host / "runs"),
            "run.cache_dir": str(host / "cache"), "model.source": "generated:tiny-llama"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def refused(host: Path, **extra: str) -> str:
    with pytest.raises(PolicyError) as info:
        checked_config(None, allowed(host, **extra))
    message = str(info.value)
    assert f"refused by the worker policy ({host / 'policy.yaml'})" in message
    return message


def test_a_run_inside_the_policy_is_allowed(host):
    cfg = checked_config(str(host / "configs" / "run.yaml"), allowed(host))
    assert cfg.run.name == "x" and not policy_mod.secrets_allowed()


def test_remote_code_is_refused_naming_the_key(host):
    assert "model.trust_remote_code=true runs code from the model repository" in refused(
        host, **{"model.trust_remote_code": "true"})
    assert "hardware.attn_implementation=kernels-community/flash-attn loads a Hub kernel" in refused(
        host, **{"hardware.attn_implementation": "kernels-community/flash-attn"})
    assert "eval.attn_implementation=kernels-community/flash-attn loads a Hub kernel" in refused(
        host, **{"eval.attn_implementation": "kernels-community/flash-attn"})


@pytest.mark.parametrize("key", ["run.output_dir", "run.cache_dir"])
def test_output_and_cache_paths_must_resolve_inside_their_roots(host, key):
    root = host / ("runs" if key == "run.output_dir" else "cache")
    (root / "link").symlink_to(host / "outside")
    for escape in (host / "outside", f"{root}/../outside", root / "link", root / "link" / "deeper"):
        message = refused(host, **{key: str(escape)})
        assert f"{key}={escape} resolves to {host / 'outside'}" in message


def test_kernels_for_layers_are_remote_code(host, tmp_path):
    """hardware.kernels imports a kernel repository's Python in every worker, from the Hub or a local directory."""
    message = refused(host, **{"hardware.kernels": "{RMSNorm: 'kernels-community/liger_kernels:LigerRMSNorm', "
                                                   f"SiLU: '{tmp_path}/evil:Silu'}}"})
    assert ("hardware.kernels.RMSNorm=kernels-community/liger_kernels:LigerRMSNorm loads kernel code from the Hub; "
            "the policy does not allow remote code") in message
    assert f"hardware.kernels.SiLU={tmp_path}/evil:Silu loads kernel code from a local directory" in message


def test_cache_root_from_the_environment_is_checked_too(host, monkeypatch):
    monkeypatch.setenv("FINETUNE_FLOWS_CACHE", str(host / "outside"))
    assert f"FINETUNE_FLOWS_CACHE={host / 'outside'} resolves" in refused(host)


def test_data_outside_the_data_roots_is_refused_without_reading_it(host):
    (host / "data" / "link.jsonl").symlink_to(host / "outside" / "secret.jsonl")
    secret = host / "outside" / "secret.jsonl"
    for path in (secret, host / "data" / "link.jsonl", f"{host}/data/../outside/secret.jsonl"):
        message = refused(host, **{"data.source": str(path)})
        assert "outside the policy's data_roots" in message and "hunter2" not in message
    assert "data.eval_source" in refused(host, **{"data.eval_source": str(host / "outside" / "secret.jsonl")})
    assert "hub_datasets: false" in refused(host, **{"data.source": "hub:org/data"})


def test_training_joins_only_the_clusters_and_rendezvous_the_policy_names(host):
    assert "hardware.ray_address=10.0.0.9:6379 is not among the policy's ray_addresses (auto)" in refused(
        host, **{"hardware.launcher": "ray", "hardware.ray_address": "10.0.0.9:6379"})
    assert "hardware.rdzv_endpoint=evil.example:29400 is not among the policy's rdzv_endpoints (none)" in refused(
        host, **{"hardware.nodes": 2, "hardware.rdzv_endpoint": "evil.example:29400"})
    assert "tracking.mlflow_uri=http://collector.example:5000 is not among the policy's mlflow_uris" in refused(
        host, **{"tracking.mlflow_uri": "http://collector.example:5000"})
    policy = read_policy(host / "policy.yaml").model_copy(update={"rdzv_endpoints": ["node1.cluster:*"]})
    ok = load_config(None, allowed(host, **{"hardware.nodes": 2, "hardware.rdzv_endpoint": "node1.cluster:29400"}))
    assert config_problems(policy, ok) == []


def test_model_sources_are_patterns_and_local_directories(host):
    assert "model.source=Qwen/Qwen3-0.6B is not among the policy's model_sources" in refused(
        host, **{"model.source": "Qwen/Qwen3-0.6B"})
    assert "model.source" in refused(host, **{"model.source": str(host / "outside")})
    policy = read_policy(host / "policy.yaml").model_copy(update={"model_sources": ["Qwen/*", str(host / "data")]})
    ok = load_config(None, allowed(host, **{"model.source": "Qwen/Qwen3-0.6B"}))
    assert config_problems(policy, ok) == []


def test_the_config_file_and_the_adapter_are_checked_before_they_are_read(host):
    with pytest.raises(PolicyError, match=r"config=/etc/passwd resolves to /etc/passwd, outside"):
        checked_config("/etc/passwd", allowed(host))
    with pytest.raises(PolicyError, match="adapter=.* outside the policy's output_roots or cache_roots"):
        check_adapter_path(host / "outside")
    check_adapter_path(host / "runs" / "some-run" / "adapter")


def test_an_adapter_named_by_a_merged_checkpoints_card_is_read_only_inside_the_roots(host):
    """The card is data: the adapter it names is read like the directory given, or left out (with a log line)."""
    from finetune_flows.evaluation.adapters import named_adapter

    def merged_naming(adapter: Path) -> Path:
        merged = host / "runs" / "some-run" / "merged"
        merged.mkdir(parents=True, exist_ok=True)
        (merged / "README.md").write_text(f"---\nbase_model: x\nfinetune_flows:\n  adapter: {json.dumps(str(adapter))}"
                                          "\n---\n\n# card\n")
        return merged

    for where in (host / "outside" / "adapter", host / "runs" / "some-run" / "adapter"):
        where.mkdir(parents=True)
        for name in ("adapter_config.json", "tokenizer_config.json"):
            (where / name).write_text("{}")
        (where / "adapter_model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # whole, no tensor
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("finetune_flows").addHandler(handler)  # run_logger() outside a flow run
    try:
        assert named_adapter(merged_naming(host / "outside" / "adapter")) is None
    finally:
        logging.getLogger("finetune_flows").removeHandler(handler)
    assert "outside the policy's output_roots or cache_roots" in records[0].getMessage()
    adapter = host / "runs" / "some-run" / "adapter"
    assert named_adapter(merged_naming(adapter)) == adapter


def test_a_policy_that_does_not_parse_refuses_everything(host):
    (host / "policy.yaml").write_text("remote_code: true\nallow_everything: true\n")
    with pytest.raises(PolicyError, match="cannot be used"):
        checked_config(None, allowed(host))


def test_local_runs_without_a_policy_keep_their_freedom(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    assert current_policy() is None
    cfg = checked_config(None, ["model.trust_remote_code=true", "run.output_dir=/tmp/anywhere"])
    assert cfg.model.trust_remote_code and policy_mod.secrets_allowed()


def test_deployment_runs_without_a_policy_get_the_safe_defaults_with_the_hosts_cache(tmp_path, monkeypatch):
    """A worker (or a Kubernetes pod) without FINETUNE_FLOWS_POLICY whose FINETUNE_FLOWS_CACHE names its cache: its
    deployment runs may use that cache, as `make worker`'s written defaults would allow; a run cannot set it."""
    monkeypatch.delenv(POLICY_ENV, raising=False)
    monkeypatch.setenv("FINETUNE_FLOWS_CACHE", str(tmp_path / "shared"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(policy_mod._Decision, "secrets_allowed", None)
    monkeypatch.setattr(policy_mod, "in_deployment_run", lambda: True)
    monkeypatch.setattr(policy_mod, "refuse_host_settings_in_job_variables", lambda: None)  # (needs a server)
    saved = dict(os.environ)
    try:
        assert checked_config(None, ["model.source=generated:tiny-llama"]).cache_root == tmp_path / "shared"
        assert current_policy().output_roots == [tmp_path / "runs"]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    found = policy_mod.host_setting_problems({"the deployment's": None,
                                              "the run's": {"env": {"FINETUNE_FLOWS_CACHE": "/home/me/.ssh"}}})
    assert found == ["the run's job variables set env FINETUNE_FLOWS_CACHE: the cache root is the worker host's "
                     "to choose, not a run's"]


def test_make_worker_writes_the_safe_defaults_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "etc" / "policy.yaml"
    assert policy_mod.main([str(path)]) == 0
    written = read_policy(path)
    assert written == Policy.safe_defaults(tmp_path).model_copy(update={"source": str(path)})
    assert not written.remote_code and written.data_roots == [tmp_path / "data"]
    path.write_text(path.read_text().replace("remote_code: false", "remote_code: true"))
    assert policy_mod.main([str(path)]) == 0 and read_policy(path).remote_code  # the host's edits are kept
    # a host whose cache is elsewhere (shared storage, deployments/README.md): its runs may use it
    monkeypatch.setenv("FINETUNE_FLOWS_CACHE", str(tmp_path / "shared" / "cache"))
    assert policy_mod.main([str(tmp_path / "other.yaml")]) == 0
    assert read_policy(tmp_path / "other.yaml").cache_roots == [tmp_path / "shared" / "cache"]


def test_secret_names():
    env = {"HF_TOKEN": "x", "HUGGING_FACE_HUB_TOKEN": "x", "PREFECT_API_KEY": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "PREFECT_API_AUTH_STRING": "x", "DB_PASSWORD": "x", "TOKENIZERS_PARALLELISM": "false", "PATH": "/bin",
           "CUDA_VISIBLE_DEVICES": "0"}
    assert set(strip_secrets(env)) == {"TOKENIZERS_PARALLELISM", "PATH", "CUDA_VISIBLE_DEVICES", "HF_TOKEN_PATH"}


def test_worker_processes_get_no_secrets_unless_the_policy_trusts_the_source(host, monkeypatch, tmp_path):
    from finetune_flows.runtime.launcher import run_worker

    probe = ("import json, os, sys; open(os.path.join(sys.argv[1], 'env.result.json'), 'w')"
             ".write(json.dumps(dict(os.environ)))")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    checked_config(None, allowed(host))
    env = run_worker("env", [sys.executable, "-c", probe, str(tmp_path)], {}, tmp_path)
    assert "HF_TOKEN" not in env and "hf_secret_value" not in json.dumps(env)
    assert env["HF_TOKEN_PATH"] == "/dev/null"

    (host / "policy.yaml").write_text(yaml.safe_dump({"data_roots": ["data"], "output_roots": ["runs"],
                                                      "cache_roots": ["cache"], "secrets_for": ["generated:*"]}))
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    checked_config(None, allowed(host))
    env = run_worker("env", [sys.executable, "-c", probe, str(tmp_path)], {}, tmp_path)
    assert env["HF_TOKEN"] == "hf_secret_value"


def test_a_run_logging_to_an_allowed_mlflow_server_keeps_its_credentials_in_the_flow_process_only(
        host, monkeypatch, tmp_path):
    """A deployment run dropped MLFLOW_TRACKING_PASSWORD from the flow process, which logs to MLflow, so a server
    asking for credentials could be reached only with a password in the URI (then in the run's parameters)."""
    from finetune_flows.runtime.launcher import run_worker

    (host / "policy.yaml").write_text(yaml.safe_dump({"data_roots": ["data"], "output_roots": ["runs"],
                                                      "cache_roots": ["cache"], "mlflow_uris": ["http://mlflow:*"]}))
    probe = ("import json, os, sys; open(os.path.join(sys.argv[1], 'env.result.json'), 'w')"
             ".write(json.dumps(dict(os.environ)))")
    for name in ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN"):
        monkeypatch.setenv(name, "the_secret")
    checked_config(None, allowed(host, **{"tracking.mlflow_uri": "http://mlflow:5000"}))
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == os.environ["MLFLOW_TRACKING_TOKEN"] == "the_secret"
    assert "HF_TOKEN" not in os.environ
    env = run_worker("env", [sys.executable, "-c", probe, str(tmp_path)], {}, tmp_path)
    assert "the_secret" not in json.dumps(env)  # the workers never get them
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "the_secret")
    checked_config(None, allowed(host))  # no tracking server: nothing to keep it for
    assert "MLFLOW_TRACKING_PASSWORD" not in os.environ
    # a password in the URI is shown as *** where the URI is named
    assert "http://alice:***@collector:5000 is not among" in refused(
        host, **{"tracking.mlflow_uri": "http://alice:s3cret@collector:5000"})
