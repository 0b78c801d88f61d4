"""Shared by the fault suite's files (tests/test_faults*.py): the short runs they inject faults into, and how they
start and watch a CLI run from outside."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from conftest import tiny_overrides
from finetune_flows.runtime.processes import ProcessId, read_record

ROOT = Path(__file__).resolve().parent.parent


def overrides(cache, runs, **extra):
    """Short runs that checkpoint every 2 steps and evaluate on 4 rows; each test its own seed (its own adapter)."""
    return tiny_overrides(cache, runs, **{"train.max_steps": 8, "train.save_steps": 2, "train.save_total_limit": 10,
                                          "train.logging_steps": 1, "eval.max_samples": 4, **extra})


def start_cli(args: list[str], env: dict[str, str], log: Path, own_group: bool = False) -> subprocess.Popen:
    """`python flows/finetune.py` on the defaults plus `args`, as the in-process
    `finetune(load_config(None, args))` runs it; with `own_group`, as a terminal starts it: the leader of a process
    group of its own, which a Ctrl-C signals as a whole."""
    defaults = log.parent / "defaults.yaml"
    defaults.write_text("{}\n")
    argv = [sys.executable, "flows/finetune.py", "--config", str(defaults), *(x for a in args for x in ("--set", a))]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            process_group=0 if own_group else None)


def training_in_progress(cache: Path, seed: int, min_step: int, timeout: float = 600,
                         run: subprocess.Popen | None = None, log: Path | None = None) -> tuple[Path, ProcessId]:
    """The adapter directory of the run trained with `seed`, once its rank 0 runs and has passed min_step. With
    `run` (the CLI process) and its `log`, a run that ends first fails at once with the log's end, instead of after
    `timeout` (a CLI that could not even import its stack once cost a GPU tier its whole device call)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run is not None and run.poll() is not None:
            tail = log.read_text()[-3000:] if log else ""
            raise AssertionError(f"the run exited ({run.returncode}) before training with seed {seed} reached step "
                                 f"{min_step}:\n{tail}")
        for job in cache.glob("adapters/*/train.job.json"):
            out = job.parent
            try:
                same = json.loads(job.read_text())["config"]["train"]["seed"] == seed
                attempt = json.loads((out / "attempts.json").read_text())[-1]
            except (OSError, ValueError, KeyError, IndexError):
                continue
            rank = read_record(out / "ranks" / "rank-0.pid")
            if same and rank and attempt["outcome"] == "running" and (attempt["last_step"] or 0) >= min_step:
                return out, rank
        time.sleep(0.2)
    raise TimeoutError(f"no training with seed {seed} reached step {min_step}")


def device_slot(name: str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name)
