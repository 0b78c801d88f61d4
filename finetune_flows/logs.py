"""The logger: the Prefect run's logger inside a flow or task run, the project's own (`finetune_flows`) elsewhere."""

from __future__ import annotations

import logging
import sys


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run's logger inside a flow or task run, else ours. A worker process never has a Prefect run and
    never imports Prefect (orchestration/steps.py says why), so the code it shares with the flow logs to ours
    there."""
    if "prefect" not in sys.modules:
        return logging.getLogger("finetune_flows")
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()
    except Exception:  # outside a flow/task run (plain function calls in tests)
        return logging.getLogger("finetune_flows")
