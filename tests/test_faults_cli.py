"""The fault suite for a plain CLI run (`python flows/finetune.py`, no PREFECT_API_URL): its own temporary Prefect
server under SIGTERM and SIGKILL (real processes, real signals, real servers)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import child_env, tiny_overrides
from fault_support import ROOT, start_cli, training_in_progress
from finetune_flows.runtime.lifecycle import FAULTS_ENV
from finetune_flows.runtime.processes import ProcessId, tree, wait_gone

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


def test_one_sigterm_ends_the_cli_in_time_though_its_server_is_already_gone(shared_cache, tmp_path):
    """As `timeout` stops `make run` (SIGTERM to the whole process group): the temporary server is gone before the
    run unwinds, and Prefect's crash report and its event worker's drain at exit retry a server that is not there.
    Each step sleeps 0.1 s first, so training still runs when the signal comes (the tiny model alone takes ~5 s)."""
    cache, log, grace = shared_cache / "cli-faults", tmp_path / "cli.log", 10
    env = {**home_env(tmp_path), FAULTS_ENV: json.dumps({"step_seconds": 0.1})}
    proc = start_cli(training_run(cache, tmp_path, seed=901, **{"hardware.stop_grace_seconds": grace}), env, log)
    try:
        training_in_progress(cache, 901, min_step=2, run=proc, log=log)
        members, server = tree(proc.pid), temporary_server(proc.pid)
        assert server is not None, members
        server.signal(signal.SIGTERM)
        assert wait_gone([server], 30)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=grace + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the CLI was still running {grace + 30} s after one SIGTERM:\n{log.read_text()[-3000:]}")
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert took < grace + 15, f"the CLI took {took:.0f} s to end after SIGTERM"  # margin 10 s, slack 5 s
    assert wait_gone(members, 30), "a process of the run outlived it"
    assert "stopped by SIGTERM" in log.read_text()
    print(f"FAULT SIGTERM with the temporary server gone: the CLI exited {took:.1f} s after the signal "
          f"(grace {grace} s)")


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


@contextlib.contextmanager
def reaped(proc: subprocess.Popen):
    """`proc`, killed on the way out if it still runs (a failed assertion included)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def sigkill_takes_the_server_along(proc: subprocess.Popen, server: ProcessId, what: str) -> None:
    members = tree(proc.pid)
    proc.kill()  # no handler, no atexit hook runs
    proc.wait(30)
    assert wait_gone([server], 30), f"the {what}'s temporary server outlived its SIGKILL"
    assert wait_gone(members, 60), f"a process of the {what} outlived it"


def test_sigkill_of_the_cli_takes_its_server_along_and_a_stale_server_does_not_block_the_next_run(
        shared_cache, tmp_path):
    cache, log = shared_cache / "cli-faults", tmp_path / "cli.log"
    stale = orphan_a_server(tmp_path)
    try:
        with reaped(start_cli(training_run(cache, tmp_path, seed=902), home_env(tmp_path), log)) as proc:
            training_in_progress(cache, 902, min_step=2, run=proc, log=log)
            server = temporary_server(proc.pid)
            assert server is not None and server != stale, tree(proc.pid)
            sigkill_takes_the_server_along(proc, server, "CLI")
        # the next run on the same Prefect home, with a stale server from an older crash still running, finishes
        again = tmp_path / "again"
        again.mkdir()
        with reaped(start_cli(training_run(cache, tmp_path, seed=903, **{"train.max_steps": 4}), home_env(tmp_path),
                              again / "cli.log")) as proc:
            assert proc.wait(timeout=600) == 0, (again / "cli.log").read_text()[-3000:]
        assert stale.is_running()  # not ours to stop, and not in the way
        # `python flows/export.py` on that run's adapter: its temporary server dies with it as well
        [adapter] = [p.parent for p in (tmp_path / "runs").glob("*/adapter/adapter_config.json")]
        log = again / "export.log"
        with reaped(subprocess.Popen([sys.executable, "flows/export.py", "--adapter", str(adapter)], cwd=ROOT,
                                     env=home_env(tmp_path), stdout=open(log, "w"), stderr=subprocess.STDOUT)) as proc:
            server, deadline = None, time.monotonic() + 300
            while server is None and proc.poll() is None and time.monotonic() < deadline:
                server = temporary_server(proc.pid)
                time.sleep(0.1)
            assert server is not None, f"no temporary server under the export CLI:\n{log.read_text()[-3000:]}"
            sigkill_takes_the_server_along(proc, server, "export CLI")
    finally:
        stale.signal(signal.SIGKILL)
