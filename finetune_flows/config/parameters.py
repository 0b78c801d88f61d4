"""The run config as a flow parameter: the JSON that a deployment and `prefect deployment run --params` carry.

`prefect deploy` runs `deployment_config` as a build step (deployments/prefect.yaml), so a deployment's
`config` parameter is its YAML file loaded into the typed model, every key written out: the Prefect UI's run form
shows those values. `make deploy` first runs `python -m finetune_flows.config.parameters deployments/prefect.yaml`,
which loads every file those build steps name: a YAML file with a bad key stops it with the config's own message
alone (Prefect's run of the build step prints that message between two tracebacks of its own).
"""

from __future__ import annotations

import json
import sys
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


def main(argv: list[str] | None = None) -> int:
    """`python -m finetune_flows.config.parameters PREFECT_FILE`: check the config of every `deployment_config`
    build step in PREFECT_FILE (paths relative to the current directory, as `prefect deploy` runs them); each bad
    one is one message naming its deployment, exit 2."""
    import yaml

    from finetune_flows.errors import UserInputError

    args = argv if argv is not None else sys.argv[1:]
    problems = []
    for deployment in yaml.safe_load(Path(args[0]).read_text()).get("deployments") or []:
        for step in deployment.get("build") or []:
            for fqn, kwargs in step.items():
                if fqn == "finetune_flows.config.parameters.deployment_config":
                    try:
                        config_parameter(kwargs["path"], kwargs.get("overrides"))
                    except UserInputError as exc:
                        problems.append(f"deployment {deployment.get('name')}: {exc}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
