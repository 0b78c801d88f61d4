"""The Makefile's own targets, run by real make in a copy of the checkout's Makefile."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_make_clean_removes_the_virtualenv_but_keeps_the_trained_runs(tmp_path):
    """`make clean` removed runs/ (every trained adapter) with the venv: resetting a broken venv lost them."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".pytest_cache").mkdir()
    adapter = tmp_path / "runs" / "demo-20261207-000000-abc123" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    done = subprocess.run(["make", "clean"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / ".venv").exists() and not (tmp_path / ".pytest_cache").exists()
    assert (adapter / "adapter_model.safetensors").read_bytes() == b"weights"


def test_make_deploy_stops_on_a_bad_config_file_with_its_message_alone(tmp_path):
    """A deployment's YAML config with a bad value failed `prefect deploy`'s build step: the message came between
    two tracebacks of Prefect's. `make deploy` now checks every build step's file first and stops there."""
    import os
    import sys

    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)  # no prefect here: it must not be reached
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "nightly.yaml").write_text("train:\n  learning_rate: -1\n  lerning: 2\n")
    (tmp_path / "deployments").mkdir()
    shutil.copy(REPO / "deployments" / "prefect.yaml", tmp_path / "deployments" / "prefect.yaml")
    (tmp_path / "configs" / "demo.yaml").write_text((REPO / "configs" / "demo.yaml").read_text())
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(["make", "-o", "pool", "-o", "limits", "deploy"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert ("error: deployment nightly: configs/nightly.yaml: 2 problem(s):\n"
            "  - train.learning_rate: Input should be greater than 0 (got -1)\n"
            "  - train.lerning: unknown key") in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and ".venv/bin/prefect" not in done.stderr, done.stderr  # stopped first


STUB_FLOW = """
import os, signal, sys, time
def stopped(signum, frame):
    with open("signals", "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    os._exit(128 + signum)
signal.signal(signal.SIGTERM, stopped)
open("started", "w").write(str(os.getpid()))
time.sleep(120)
"""


def test_make_run_ends_with_its_make_sigkilled_or_sent_sigterm(tmp_path):
    """A SIGKILLed `make run` left its run going, orphaned, to the end (measured: 160 s of quantizing, training,
    evaluating and merging after make was gone). The run now gets one SIGTERM, its graceful stop, either way."""
    import os
    import signal
    import sys
    import time

    from finetune_flows.runtime.processes import ProcessId

    env = dict(os.environ, PYTHONPATH=str(REPO))
    for how in (signal.SIGKILL, signal.SIGTERM):
        work = tmp_path / how.name
        (work / "flows").mkdir(parents=True)
        shutil.copy(REPO / "Makefile", work / "Makefile")
        (work / "flows" / "finetune.py").write_text(STUB_FLOW)  # a run that lasts, and records its signals
        make = subprocess.Popen(["make", "-o", ".venv/.installed", "run", f"PY={sys.executable}"], cwd=work, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not (work / "started").exists():
                assert make.poll() is None and time.monotonic() < deadline, make.stdout.read()
                time.sleep(0.1)
            time.sleep(0.2)  # the pid is written
            run = ProcessId.of(int((work / "started").read_text()))
            make.send_signal(how)
            deadline = time.monotonic() + 20
            while run.is_running() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not run.is_running(), f"the run outlived its make ({how.name})"
            assert (work / "signals").read_text() == "SIGTERM\n"  # one SIGTERM: its graceful stop, not two
        finally:
            try:
                os.killpg(make.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            make.wait()
