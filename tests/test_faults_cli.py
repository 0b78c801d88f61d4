"""The fault suite for a plain CLI run (`python flows/finetune.py`, no PREFECT_API_URL): its own temporary Prefect
server under SIGTERM and SIGKILL (real processes, real signals, real servers)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env, tiny_overrides
from fault_support import start_cli, training_in_progress
from tasks.processes import ProcessId, tree, wait_gone

pytestmark = pytest.mark.slow

SERVER_APP = b"prefect.server.api.server:create_app"


def home_env(home: Path) -> dict[str, str]:
    """A CLI that starts its own temporary server on the Prefect home `home`."""
    env = child_env(PREFECT_HOME=str(home / "prefect-home"), PREFECT_LOCAL_STORAGE_PATH=str(home / "storage"))
    env.pop("PREFECT_API_URL", None)
    return env


def temporary_server(pid: int) -> ProcessId | None:
    for member in tree(pid):
        try:
            if SERVER_APP in Path(f"/proc/{member.pid}/cmdline").read_bytes():
                return member
        except OSError:
            pass
    return None


def training_run(cache: Path, tmp_path: Path, seed: int, **extra) -> list[str]:
    return tiny_overrides(cache, tmp_path / "runs", **{"train.seed": seed, "train.max_steps": 300,
                                                       "train.save_steps": 100, **extra})


def orphan_a_server(home: Path) -> ProcessId:
    """A temporary server whose starter died by SIGKILL without a parent-death signal: what a crashed run left
    behind before servers died with their CLI."""
    code = ("import os, sys; from prefect.server.api.server import SubprocessASGIServer\n"
            "server = SubprocessASGIServer(); server.start(timeout=180)\n"
            "open(sys.argv[1], 'w').write(str(server.server_process.pid)); os.kill(os.getpid(), 9)\n")
    record, log = home / "stale-server.pid", home / "stale-server.log"
    with open(log, "w") as out:  # a file, not a pipe: the orphan keeps its end open
        subprocess.run([sys.executable, "-c", code, str(record)], env=home_env(home), stdout=out,
                       stderr=subprocess.STDOUT, timeout=300)
    ident = ProcessId.of(int(record.read_text()))
    assert ident is not None and ident.is_running(), log.read_text()[-2000:]
    return ident


def test_sigkill_of_the_cli_takes_its_server_along_and_a_stale_server_does_not_block_the_next_run(
        shared_cache, tmp_path):
    cache, log = shared_cache / "cli-faults", tmp_path / "cli.log"
    stale = orphan_a_server(tmp_path)
    try:
        proc = start_cli(training_run(cache, tmp_path, seed=902), home_env(tmp_path), log)
        try:
            training_in_progress(cache, 902, min_step=2, run=proc, log=log)
            members, server = tree(proc.pid), temporary_server(proc.pid)
            assert server is not None and server != stale, members
            proc.kill()  # no handler, no atexit hook runs
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert wait_gone([server], 30), "the CLI's temporary server outlived its SIGKILL"
        assert wait_gone(members, 60), "a process of the run outlived it"
        # the next run on the same Prefect home, with a stale server from an older crash still running, finishes
        again = tmp_path / "again"
        again.mkdir()
        proc = start_cli(training_run(cache, tmp_path, seed=903, **{"train.max_steps": 4}), home_env(tmp_path),
                         again / "cli.log")
        try:
            assert proc.wait(timeout=600) == 0, (again / "cli.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
        assert stale.is_running()  # not ours to stop, and not in the way
    finally:
        stale.signal(signal.SIGKILL)
