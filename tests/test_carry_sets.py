"""benchmarks/carry_sets.py: the wheel sets for the lent GPU machines (building them needs PyPI; these parts do not)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile

import pytest

from conftest import load_benchmark

carry = load_benchmark("carry_sets")


def record_digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_a_slimmed_wheel_drops_the_entries_and_its_own_record_lists_exactly_what_is_left(tmp_path):
    files = {"ray/__init__.py": b"x = 1\n", "ray/jars/ray_dist.jar": b"J" * 1000, "ray/rllib/algo.py": b"rl\n",
             "ray/dashboard/client/build/main.js.map": b"{}", "ray/dashboard/client/build/main.js": b"js",
             "ray/_private/thirdparty/pkg-1.0.dist-info/RECORD": b"pkg/__init__.py,,\n"}
    wheel = tmp_path / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        listing = [f"{n},," for n in files] + ["ray-2.60.0.dist-info/RECORD,,"]
        z.writestr("ray-2.60.0.dist-info/RECORD", "\n".join(listing) + "\n")

    carry.slim_wheel(wheel, carry.RAY_DROP)

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert names == {"ray/__init__.py", "ray/dashboard/client/build/main.js",
                         "ray/_private/thirdparty/pkg-1.0.dist-info/RECORD", "ray-2.60.0.dist-info/RECORD"}
        # a vendored package's RECORD is left as it was; the wheel's own lists every member with its hash
        assert z.read("ray/_private/thirdparty/pkg-1.0.dist-info/RECORD") == b"pkg/__init__.py,,\n"
        rows = {r[0]: r[1:] for r in csv.reader(io.StringIO(z.read("ray-2.60.0.dist-info/RECORD").decode()))}
        assert set(rows) == names
        assert rows["ray/__init__.py"] == [record_digest(b"x = 1\n"), "6"]
        assert rows["ray-2.60.0.dist-info/RECORD"] == ["", ""]


def test_the_sets_use_the_versions_pyproject_pins():
    pinned = carry.pins()
    assert pinned["transformers"].startswith("transformers==") and pinned["prefect"].startswith("prefect==")
    assert pinned["ray"].startswith("ray[train]==") and pinned["flash-attn-4"].startswith("flash-attn-4==")
    assert set(carry.CORE) <= set(pinned)


def test_the_peers_set_cuts_unsloth_studio_and_reads_what_the_image_has():
    assert carry.UNSLOTH_DROP.search("studio/frontend/dist/assets/chat.js")
    assert not carry.UNSLOTH_DROP.search("unsloth/models/llama.py") and not carry.UNSLOTH_DROP.search(
        "unsloth-2026.10.9.dist-info/RECORD")
    if not (carry.SHARED / "make-wheel-bundle.sh").is_file():
        pytest.skip("the shared device tools are not beside this checkout")
    image = carry.image_packages().split()
    # the peers resolve against the image's transformers (Unsloth pins <= 5.17), never the core set's
    assert "transformers==5.17.0" in image and "torch==2.11.0+cu130" in image
    assert not set(carry.PEERS_SKIP) & {line.split("==")[0] for line in image}
