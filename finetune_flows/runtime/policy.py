"""What a worker host lets a run do: a policy the host sets and run parameters cannot change.

A deployment run executes with the worker host's files and credentials, on parameters anyone with access to
the Prefect API can choose. The policy file (YAML, path in `FINETUNE_FLOWS_POLICY`; `make worker` writes one with
the defaults below) says what such a run may do:

    remote_code: false            # model.trust_remote_code, Hub kernel ids as attention backends, and
                                  # hardware.kernels (Hub repos or local kernel directories: code either way)
    model_sources: [builtin:*, generated:*]   # patterns for built-in/generated/Hub ids; directories for local paths
    hub_datasets: false           # data.source=hub:...
    data_roots: [<checkout>/data] # local data files (data.source, data.eval_source) must lie inside one of these
    config_roots: [<checkout>/configs]  # config files a run reads (the CLI's --config; the config.resolved.yaml
                                        # of an adapter's run under an output root is allowed too)
    output_roots: [<checkout>/runs]     # run.output_dir
    cache_roots: [~/.cache/finetune-flows]   # run.cache_dir (or FINETUNE_FLOWS_CACHE)
    secrets_for: []               # model sources (patterns) whose runs may see HF_TOKEN and other secrets
    ray_addresses: [auto]         # hardware.ray_address values (patterns) training may join: `auto` is the
                                  # cluster this host joined itself
    rdzv_endpoints: []            # hardware.rdzv_endpoint values (patterns) a multi-node torchrun may meet at
    mlflow_uris: []               # tracking.mlflow_uri values (patterns) runs may send their results to (the
                                  # flow process keeps MLFLOW_TRACKING_PASSWORD/TOKEN for it; workers never)

Paths are resolved (symlinks, `..`) before they are compared; relative roots are relative to the policy file.
A run that asks for more is refused before anything is read or written, with one message naming each key and
the policy. Without `FINETUNE_FLOWS_POLICY`, a deployment run gets these defaults (fail closed; the cache root is
the host's FINETUNE_FLOWS_CACHE, if set) and a local CLI run keeps its freedom. The policy path and the cache root are
the worker host's: a deployment run whose job variables set either is refused.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from finetune_flows.config.schema import ATTENTION_BACKENDS, FinetuneConfig, load_config
from finetune_flows.errors import UserInputError, redact_uri
from finetune_flows.logs import run_logger

POLICY_ENV = "FINETUNE_FLOWS_POLICY"
CACHE_ENV = "FINETUNE_FLOWS_CACHE"
DEFAULT_CACHE = "~/.cache/finetune-flows"
# Environment variables treated as secrets: tokens, keys, passwords, credentials (TOKENIZERS_PARALLELISM is not).
SECRET_NAME = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|AUTH_STRING|CREDENTIALS?)($|_)")
PREFECT_CLIENT = ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING")  # the flow process needs these to report
# MLflow's client credentials: the flow process logs the run to a tracking.mlflow_uri the policy allows
MLFLOW_CLIENT = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


class PolicyError(UserInputError):
    """The run asks for something the worker's policy does not allow."""


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    remote_code: bool = False
    model_sources: list[str] = Field(default_factory=lambda: ["builtin:*", "generated:*"])
    hub_datasets: bool = False
    data_roots: list[Path] = []
    config_roots: list[Path] = []
    output_roots: list[Path] = []
    cache_roots: list[Path] = Field(default_factory=lambda: [Path(DEFAULT_CACHE)])
    secrets_for: list[str] = []
    ray_addresses: list[str] = Field(default_factory=lambda: ["auto"])
    rdzv_endpoints: list[str] = []
    mlflow_uris: list[str] = []
    source: str = Field("built-in safe defaults", exclude=True)  # where it came from, for messages

    @classmethod
    def safe_defaults(cls, checkout: Path, cache: str | None = None) -> "Policy":
        """The defaults for a checkout; `cache`: the cache root the host names (its FINETUNE_FLOWS_CACHE) instead
        of DEFAULT_CACHE."""
        return cls(data_roots=[checkout / "data"], config_roots=[checkout / "configs"],
                   output_roots=[checkout / "runs"], cache_roots=[Path(cache or DEFAULT_CACHE)]).resolved(checkout)

    def resolved(self, base: Path) -> "Policy":
        def fix(paths: list[Path]) -> list[Path]:
            return [(base / Path(p).expanduser()).resolve() for p in paths]

        return self.model_copy(update={k: fix(getattr(self, k)) for k in
                                       ("data_roots", "config_roots", "output_roots", "cache_roots")})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def read_policy(path: Path) -> Policy:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        return Policy.model_validate(raw).resolved(path.parent.resolve()).model_copy(update={"source": str(path)})
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        # Fail closed: a policy that cannot be read refuses every run rather than allowing everything.
        raise PolicyError(f"worker policy {path} ({POLICY_ENV}) cannot be used: {exc}".splitlines()[0]) from None


def in_deployment_run() -> bool:
    """Whether this flow run was created from a deployment (read from the server, not from the parameters)."""
    try:
        from prefect.runtime import deployment

        return deployment.id is not None
    except Exception:  # outside a flow run
        return False


def current_policy() -> Policy | None:
    """The host's policy: the file `FINETUNE_FLOWS_POLICY` names; the safe defaults for a deployment run
    without one; none for a local run. A deployment run whose job variables set the policy path is refused."""
    deployed = in_deployment_run()
    if deployed:
        refuse_host_settings_in_job_variables()
    path = os.environ.get(POLICY_ENV)
    if path:
        return read_policy(Path(path).expanduser())
    if deployed:  # the cache the host names (a Kubernetes pod's claim at /cache); job variables cannot set it
        return Policy.safe_defaults(Path.cwd(), os.environ.get(CACHE_ENV))
    return None


def refuse_host_settings_in_job_variables() -> None:
    """A process worker starts the flow with its own environment updated by the job variables' `env` (the
    deployment's, then the run's), and any API caller can set those: `--job-variable env='{"FINETUNE_FLOWS_POLICY":
    ...}'` would point the run at a policy of the caller's. The policy path, and the `command` that starts the flow
    process, are the worker host's: a run whose job variables set either is refused (read from the server).
    `make worker`'s worker (deployments/worker.py) refuses such runs before they start; this catches them under a
    worker started without that check."""
    from uuid import UUID

    from prefect import get_client
    from prefect.runtime import deployment, flow_run

    with get_client(sync_client=True) as client:
        sources = {"the deployment's": client.read_deployment(UUID(str(deployment.id))).job_variables,
                   "the run's": flow_run.job_variables}
    problems = host_setting_problems(sources)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise PolicyError(f"refused by the worker policy (the worker's {POLICY_ENV}):\n{lines}")


def host_setting_problems(sources: dict[str, dict | None]) -> list[str]:
    """What job variables ({whose: variables}) set of the worker host's own settings: the policy path, the cache
    root (the safe defaults allow writing there) and the command."""
    problems = []
    for whose, variables in sources.items():
        variables = variables or {}
        for name in (POLICY_ENV, CACHE_ENV):
            if name in (variables.get("env") or {}):
                what = "the worker policy" if name == POLICY_ENV else "the cache root"
                problems.append(f"{whose} job variables set env {name}: {what} is the worker host's to choose, "
                                "not a run's")
        if variables.get("command"):
            problems.append(f"{whose} job variables set command: how the flow process starts is the worker "
                            "host's to choose, not a run's")
    return problems


# ---------------------------------------------------------------- checks


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _resolve(value: str | Path) -> Path:
    return Path(value).expanduser().resolve()  # symlinks and `..` resolved before any comparison


def _is_local_path(source: str) -> bool:
    return source.startswith((".", "/", "~")) or Path(source).expanduser().exists()


def _source_allowed(source: str, patterns: list[str]) -> bool:
    if _is_local_path(source):
        roots = [_resolve(p) for p in patterns if p.startswith(("/", "~", "."))]
        return _inside(_resolve(source), roots)
    return any(fnmatch.fnmatchcase(source, p) for p in patterns if not p.startswith(("/", "~", ".")))


def _path_problem(policy: Policy, key: str, value: str | Path, roots_name: str, roots: list[Path]) -> str | None:
    if _inside(_resolve(value), roots):
        return None
    shown = ", ".join(str(r) for r in roots) or "none"
    return f"{key}={value} resolves to {_resolve(value)}, outside the policy's {roots_name} ({shown})"


def config_file_problems(policy: Policy, config: str | Path | None) -> list[str]:
    if config is None:
        return []
    problem = _path_problem(policy, "config", config, "config_roots or output_roots",
                            policy.config_roots + policy.output_roots)
    return [problem] if problem else []


def config_problems(policy: Policy, cfg: FinetuneConfig) -> list[str]:
    """Every key of the run that the policy does not allow."""
    problems = []
    if cfg.model.trust_remote_code and not policy.remote_code:
        problems.append("model.trust_remote_code=true runs code from the model repository; the policy does not allow "
                        "remote code (remote_code: false)")
    for key, attn in cfg.attention_settings().items():
        if attn != "auto" and attn not in ATTENTION_BACKENDS and not policy.remote_code:
            problems.append(f"{key}={attn} loads a Hub kernel (remote code); the policy does not allow remote code "
                            "(remote_code: false)")
    if not policy.remote_code:  # a kernel repository's or directory's Python is imported by every worker
        problems += [f"hardware.kernels.{layer}={kernel} loads kernel code from "
                     f"{'a local directory' if _is_local_path(kernel.rsplit(':', 1)[0]) else 'the Hub'}; the policy "
                     "does not allow remote code (remote_code: false)"
                     for layer, kernel in cfg.hardware.kernels.items()]
    h = cfg.hardware  # a foreign cluster or rendezvous would receive this host's data and weights
    if h.launcher == "ray" and not any(fnmatch.fnmatchcase(h.ray_address, p) for p in policy.ray_addresses):
        problems.append(f"hardware.ray_address={h.ray_address} is not among the policy's ray_addresses "
                        f"({', '.join(policy.ray_addresses) or 'none'})")
    if h.rdzv_endpoint is not None and not any(fnmatch.fnmatchcase(h.rdzv_endpoint, p) for p in policy.rdzv_endpoints):
        problems.append(f"hardware.rdzv_endpoint={h.rdzv_endpoint} is not among the policy's rdzv_endpoints "
                        f"({', '.join(policy.rdzv_endpoints) or 'none'})")
    uri = cfg.tracking.mlflow_uri  # it receives the config, the eval answers and the adapter
    if uri is not None and not any(fnmatch.fnmatchcase(uri, p) for p in policy.mlflow_uris):
        problems.append(f"tracking.mlflow_uri={redact_uri(uri)} is not among the policy's mlflow_uris "
                        f"({', '.join(policy.mlflow_uris) or 'none'})")
    if not _source_allowed(cfg.model.source, policy.model_sources):
        problems.append(f"model.source={cfg.model.source} is not among the policy's model_sources "
                        f"({', '.join(policy.model_sources) or 'none'})")
    for key in ("source", "eval_source"):
        value = getattr(cfg.data, key)
        if value is None or value.startswith("builtin:"):
            continue
        if value.startswith("hub:"):
            if not policy.hub_datasets:
                problems.append(f"data.{key}={value} reads a Hub dataset; the policy does not allow them "
                                "(hub_datasets: false)")
            continue
        problems.append(_path_problem(policy, f"data.{key}", value, "data_roots", policy.data_roots))
    problems.append(_path_problem(policy, "run.output_dir", cfg.run.output_dir, "output_roots", policy.output_roots))
    env_cache = os.environ.get("FINETUNE_FLOWS_CACHE")  # what cfg.cache_root uses, when set
    cache_key, cache = ("FINETUNE_FLOWS_CACHE", env_cache) if env_cache else ("run.cache_dir", cfg.run.cache_dir)
    problems.append(_path_problem(policy, cache_key, cache, "cache_roots", policy.cache_roots))
    return [p for p in problems if p]


def refuse(policy: Policy, problems: list[str]) -> None:
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise PolicyError(f"refused by the worker policy ({policy.source}):\n{lines}")


# ---------------------------------------------------------------- secrets


class _Decision:
    secrets_allowed: bool | None = None  # None: no run has been checked in this process


def secrets_allowed() -> bool:
    if _Decision.secrets_allowed is None:
        return current_policy() is None
    return _Decision.secrets_allowed


def strip_secrets(env: dict[str, str], keep: tuple[str, ...] = ()) -> dict[str, str]:
    stripped = {k: v for k, v in env.items() if k in keep or not SECRET_NAME.search(k)}
    stripped["HF_TOKEN_PATH"] = os.devnull  # nor the token file `huggingface-cli login` leaves
    return stripped


def worker_environment(env: dict[str, str]) -> dict[str, str]:
    """A worker child's environment: secrets removed unless the policy trusts this run's model source."""
    return env if secrets_allowed() else strip_secrets(env)


# ---------------------------------------------------------------- the entry point for flows


def check_adapter_path(adapter: str | Path) -> None:
    """An adapter or merged checkpoint to evaluate (or export) must lie under the policy's output or cache roots
    (checked before it is read)."""
    policy = current_policy()
    if policy is not None:
        problem = _path_problem(policy, "adapter", adapter, "output_roots or cache_roots",
                                policy.output_roots + policy.cache_roots)
        refuse(policy, [problem] if problem else [])


def checked_config(config: str | Path | None, overrides: list[str] | None) -> FinetuneConfig:
    """Load a config file under the host's policy: a file outside the policy's roots is refused before it is read,
    then the config as `allowed_config` checks it."""
    return allowed_config(load_config(allowed_config_file(config), overrides))


def allowed_config_file(path: str | Path | None) -> str | Path | None:
    """A config file a flow reads (an adapter's training config): refused unless it lies under the policy's config
    or output roots, before it is read."""
    policy = current_policy()
    if policy is not None:
        refuse(policy, config_file_problems(policy, path))
    return path


def allowed_config(cfg: FinetuneConfig) -> FinetuneConfig:
    """The run's config under the host's policy: refused (PolicyError) before anything is read or written if it
    asks for more than the policy allows. Records whether this run's workers may see secrets."""
    return _allowed(current_policy(), cfg)


def _allowed(policy: Policy | None, cfg: FinetuneConfig) -> FinetuneConfig:
    if policy is None:
        _Decision.secrets_allowed = True
        return cfg
    refuse(policy, config_problems(policy, cfg))
    trusted = any(fnmatch.fnmatchcase(cfg.model.source, p) for p in policy.secrets_for)
    _Decision.secrets_allowed = trusted
    if not trusted:  # code this run loads in the flow process (a tokenizer) must not find them either
        # (its workers get none: worker_environment)
        client = PREFECT_CLIENT + (MLFLOW_CLIENT if cfg.tracking.mlflow_uri else ())
        kept = strip_secrets(dict(os.environ), keep=client)
        for name in set(os.environ) - set(kept):
            del os.environ[name]
        os.environ["HF_TOKEN_PATH"] = os.devnull

    run_logger().info("worker policy %s: run allowed (remote code %s, secrets %s)", policy.source,
                      "allowed" if policy.remote_code else "refused", "passed" if trusted else "withheld")
    return cfg


def main(argv: list[str] | None = None) -> int:
    """`python -m finetune_flows.runtime.policy PATH`: write the safe default policy for this checkout to PATH,
    unless it exists."""
    import sys

    args = argv if argv is not None else sys.argv[1:]
    path = Path(args[0]).expanduser()
    if path.exists():
        read_policy(path)  # refuse to start a worker on a policy that does not parse
        print(f"worker policy: {path} (kept as it is)")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    # the worker's own environment is the host's: the cache it names is where its runs must be allowed to write
    policy = Policy.safe_defaults(Path.cwd(), os.environ.get("FINETUNE_FLOWS_CACHE"))
    path.write_text("# finetune-flows worker policy (deployments/README.md). Runs cannot change it.\n"
                    + policy.to_yaml())
    print(f"worker policy: wrote the safe defaults to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
