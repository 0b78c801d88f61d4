"""Run directories: each run gets a fresh directory holding its resolved config and results."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from pathlib import Path

from finetune_flows.config.schema import FinetuneConfig, load_config
from finetune_flows.errors import UserInputError
from finetune_flows.store.entries import write_atomic


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
    write_atomic(run_dir / "config.resolved.yaml", cfg.to_yaml())
    return run_dir


def flow_run_name() -> str:
    """`<run name>/<model>/<run id>`: what a person scans for in the Prefect UI."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    try:
        cfg = load_config(params.get("config"), params.get("overrides"))
    except Exception:
        return f"finetune-{params.get('config')}"
    model = cfg.model.source.split(":")[-1].split("/")[-1]
    return f"{cfg.run.name}/{model}/{str(flow_run.id)[:8]}"
