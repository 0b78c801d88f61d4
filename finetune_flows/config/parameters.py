"""The run config as a flow parameter: the JSON that a deployment and `prefect deployment run --params` carry.

`prefect deploy` runs `deployment_config` as a build step (deployments/prefect.yaml), so a deployment's
`config` parameter is its YAML file loaded into the typed model, every key written out: the Prefect UI's run form
shows those values, and a YAML file with a bad key fails `make deploy` with the config's own message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune_flows.config.schema import load_config


def config_parameter(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A config file plus `key=value` overrides, validated, as the JSON value of a flow's `config` parameter."""
    return load_config(path, overrides).model_dump(mode="json")


def deployment_config(path: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """A `prefect deploy` build step: `{"config": ...}` for the deployment's `parameters` to name as
    `{{ <step id>.config }}`."""
    return {"config": config_parameter(path, overrides)}


def run_parameters(path: str | Path | None, overrides: list[str] | None = None) -> str:
    """`{"config": ...}` as JSON, for `prefect deployment run NAME --params "$(...)"`."""
    return json.dumps({"config": config_parameter(path, overrides)})
