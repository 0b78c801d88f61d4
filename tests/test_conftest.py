"""The test session's own housekeeping: it leaves no temporary directory behind."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, child_env

TEST = "tests/test_profiling.py::test_a_real_cpu_profile_of_training_steps_lists_the_host_ops_and_no_kernels"


def test_a_session_removes_its_temporary_directory_unless_told_to_keep_it(tmp_path):
    def session(**extra):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST], cwd=REPO,
                              env=child_env(TMPDIR=str(tmp_path), **extra), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return sorted(p.name for p in tmp_path.glob("finetune-flows-tests-*"))

    assert session() == []
    assert len(session(FINETUNE_FLOWS_KEEP_TEST_TMP="1")) == 1
