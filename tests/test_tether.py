"""`make server` and `make worker` end with the make that started them: SIGTERM to make, SIGKILL to make, and a
terminal's Ctrl-C (SIGINT to the whole group) leave no server or worker behind (finetune_flows/runtime/tether.py;
real make, real Prefect server and worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from finetune_flows.runtime.processes import ProcessId, tree, wait_gone
from tests.deploy_support import ROOT, STAMP, PrefectStack, healthy

pytestmark = pytest.mark.slow


def up(check, proc: subprocess.Popen, log, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)


def end_make(proc: subprocess.Popen, how: str) -> list[ProcessId]:
    """Stop make as `how` says; return what was below it, to watch."""
    below = tree(proc.pid)[1:]
    assert below, "make started nothing"
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the foreground group
    else:
        os.kill(proc.pid, getattr(signal, how))  # make alone, as a supervisor that knows only its PID
    return below


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tether")
    stack = PrefectStack(home=tmp / "home", logs=tmp / "logs")
    try:
        stack.start_server()
        stack.make("pool", "limits")
        yield stack
    finally:
        stack.close()


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL", "ctrl-c"])
def test_make_worker_leaves_no_worker_behind(stack, how):
    log = stack.logs / f"worker-{how}.log"
    proc = stack._spawn(["make", "-o", STAMP, "worker", f"FINETUNE_FLOWS_POLICY={stack.policy}"], log.stem)
    up(lambda: "started!" in log.read_text(), proc, log)
    below = end_make(proc, how)
    assert wait_gone(below, 45), f"still running after make got {how}: {[m.pid for m in below if m.is_running()]}"
    if how != "SIGKILL":  # Prefect's own graceful stop ran, not a kill
        assert "stopped!" in log.read_text(), log.read_text()[-2000:]


@pytest.mark.parametrize("how", ["SIGKILL"])  # SIGTERM and Ctrl-C reach a plain child of make already
def test_make_server_leaves_no_server_behind(stack, how):
    server = PrefectStack(home=stack.logs.parent / f"server-home-{how}", logs=stack.logs / f"server-{how}")
    log = server.logs / "make-server.log"
    proc = server._spawn(["make", "-o", STAMP, "server", f"PREFECT_PORT={server.port}"], log.stem)
    try:
        up(lambda: healthy(server.api_url), proc, log, timeout=180)
        below = end_make(proc, how)
        assert wait_gone(below, 45), f"still running after make got {how}: {[m.pid for m in below if m.is_running()]}"
        assert not healthy(server.api_url)
    finally:
        server.close()


def test_a_tether_whose_parent_is_already_gone_starts_nothing(tmp_path):
    marker = tmp_path / "started"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    result = subprocess.run([sys.executable, "-m", "finetune_flows.runtime.tether", "--parent", str(gone.pid), "--",
                             sys.executable, "-c", f"open({str(marker)!r}, 'w')"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and not marker.exists()
    assert f"process {gone.pid} that started" in result.stderr


def test_the_tether_exits_with_its_commands_status(tmp_path):
    code = ("import os, subprocess, sys; sys.exit(subprocess.call([sys.executable, '-m', "
            "'finetune_flows.runtime.tether', '--parent', str(os.getpid()), '--', sys.executable, '-c', "
            "'import sys; sys.exit(7)']))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 7


STACK_OWNER = """
import sys, time
from pathlib import Path
from tests.deploy_support import PrefectStack
stack = PrefectStack(home=Path(sys.argv[1]) / "home", logs=Path(sys.argv[1]) / "logs")
stack.start_server()
stack.start_worker()
print("up", flush=True)
time.sleep(600)
"""


def test_the_deployment_tests_stack_ends_with_a_sigkilled_pytest(tmp_path):
    """The deployment tests' own server and `make worker` (tests/deploy_support.py) die with the process that started
    them, also when it is SIGKILLed (a pytest stopped that way left both running)."""
    owner = subprocess.Popen([sys.executable, "-c", STACK_OWNER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        up(lambda: "started!" in (tmp_path / "logs" / "worker.log").read_text(), owner, tmp_path / "logs" / "worker.log")
        below = tree(owner.pid)[1:]
        assert len(below) >= 3  # the server, make, the tether and the worker
        owner.kill()
        owner.wait()
        assert wait_gone(below, 45), f"still running: {[m.pid for m in below if m.is_running()]}"
    finally:
        for member in tree(owner.pid)[1:] if owner.poll() is None else []:
            member.signal(signal.SIGKILL)
