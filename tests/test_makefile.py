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
