"""benchmarks/compile_cache.sh: the training bench's compile cache packed into parts small enough to come back from a
lent-machine call, and unpacked the same, with the machine's xz or, where it has none, Python's lzma."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "compile_cache.sh"


def tools_without_xz(tmp_path: Path) -> str:
    """A PATH holding the tools the script needs, but no xz."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "tar", "cat", "split", "mkdir"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "python3").symlink_to(sys.executable)
    return str(bin_dir)


@pytest.mark.parametrize("xz", ["xz", "python-lzma"])
def test_a_cache_packs_into_parts_under_the_size_and_unpacks_byte_for_byte(tmp_path, xz):
    if xz == "xz" and shutil.which("xz") is None:
        pytest.skip("no xz binary on this machine")
    cache = tmp_path / "cache" / "compile" / "NVIDIA-H100-80GB-HBM3-sm90" / "inductor"
    cache.mkdir(parents=True)
    (cache / "kernel.so").write_bytes(os.urandom(3 << 20))  # incompressible: three parts of 1 MiB and a rest
    (cache / "graph.py").write_text("def f(x):\n    return x\n" * 1000)
    env = {**os.environ, "PART_SIZE": "1M"} | ({} if xz == "xz" else {"PATH": tools_without_xz(tmp_path)})
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["bash", str(SCRIPT), "pack", str(tmp_path / "cache"), str(out / "compile-cache.tar.xz.")],
                   env=env, check=True)
    parts = sorted(out.iterdir())
    assert [p.name for p in parts][:4] == [f"compile-cache.tar.xz.0{i}" for i in range(4)]
    assert all(p.stat().st_size <= 1 << 20 for p in parts)
    subprocess.run(["bash", str(SCRIPT), "unpack", str(tmp_path / "back"), *map(str, parts)], env=env, check=True)
    back = tmp_path / "back" / "compile" / "NVIDIA-H100-80GB-HBM3-sm90" / "inductor"
    for name in ("kernel.so", "graph.py"):
        assert (back / name).read_bytes() == (cache / name).read_bytes()


def test_a_missing_cache_fails_the_pack_instead_of_writing_an_empty_part(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(["bash", str(SCRIPT), "pack", str(tmp_path / "none"), str(out / "p.")],
                            capture_output=True, text=True)
    assert result.returncode != 0 and list(out.iterdir()) == []
    assert "no compile cache in" in result.stderr
