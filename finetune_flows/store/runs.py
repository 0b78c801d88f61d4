"""Run directories: each run gets a fresh directory holding its resolved config and results."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from pathlib import Path

from finetune_flows.config.schema import FinetuneConfig, ModelConfig, RunConfig
from finetune_flows.errors import UserInputError
from finetune_flows.files import write_atomic


def create_run_dir(cfg: FinetuneConfig) -> Path:
    """Create `<output_dir>/<name>-<UTC time>-<random>`; never reuses or overwrites an existing directory."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    root = Path(cfg.run.output_dir).expanduser().resolve()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError, PermissionError) as exc:
        raise UserInputError(f"run.output_dir={cfg.run.output_dir}: cannot create a run directory there "
                             f"({exc.strerror}: {exc.filename})") from None
    while True:
        run_dir = root / f"{cfg.run.name}-{stamp}-{secrets.token_hex(3)}"
        try:
            run_dir.mkdir()
            break
        except FileExistsError:
            continue
    write_atomic(run_dir / "config.resolved.yaml", cfg.as_recorded().to_yaml())  # the cache used, not the one set
    return run_dir


def run_label(config: FinetuneConfig | dict | None) -> str:
    """`<run name>/<model>` of a flow run's `config` parameter (the model, or its JSON as a deployment run's
    parameters hold it), read without validating the config again."""
    raw = config.model_dump(mode="json") if isinstance(config, FinetuneConfig) else config or {}
    name = (raw.get("run") or {}).get("name") or RunConfig.model_fields["name"].default
    source = str((raw.get("model") or {}).get("source") or ModelConfig.model_fields["source"].default)
    return f"{name}/{source.split(':')[-1].split('/')[-1]}"


def flow_run_name() -> str:
    """`<run name>/<model>/<run id>`: what a person scans for in the Prefect UI."""
    from prefect.runtime import flow_run

    return f"{run_label(flow_run.parameters.get('config'))}/{str(flow_run.id)[:8]}"
