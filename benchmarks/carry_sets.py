"""Build the wheel sets the lent H200 machines lack, each small enough to travel with one device call.

The lent machines (Python 3.12, torch 2.11+cu130, transformers 5.17, no network) lack prefect, bitsandbytes,
datasets, kernels, liger-kernel, flash-attn-4 and ray, and a call carries at most 64 MiB with the working tree. This
script, run here (it needs PyPI), writes ignored folders under `.carry/` with the versions `pyproject.toml` pins:

  .carry/core        prefect, datasets, kernels, bitsandbytes, liger-kernel, transformers and what they need (~57 MiB)
  .carry/ray         ray[train] without its Java jar, rllib and the dashboard's source maps (~42 MiB; 76 MiB whole)
  .carry/fa4/p1, p2  flash-attn-4 and the CUTLASS DSL (~105 MiB), staged in two parts by stage-for-carry.sh
  .carry/peers       Unsloth, TRL and what they need beside the image's transformers 5.17 (the training bench's peer
                     rows): a site of its own, never on the same path as core's transformers (~24 MiB)
  .carry/bench       what `make bench-train` needs, peers included, in one call (~39 MiB): core without Prefect
                     (the bench and its workers never import it) for /tmp/site, the peers for /tmp/peers; the
                     wheels both use are stored once, `site.txt` and `peers.txt` list each site's

It calls `../shared/device/make-wheel-bundle.sh` (which leaves out what the image has) and `stage-for-carry.sh`.
On the device, install a set with
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .carry/core/*.whl
and `printf "import site\\nsite.addsitedir('/tmp/site')\\n" > /tmp/site/sitecustomize.py` (FA4's `.pth` files must
load in every worker), then `export PYTHONPATH=/tmp/site`; FA4's parts: `bash .carry/fa4/p1/assemble.sh` in one call,
`bash .carry/fa4/p2/assemble.sh` in the next (the machine keeps /tmp between back-to-back calls), then install
`/tmp/stage/files/*.whl`. The peers set goes into its own site, `--target /tmp/peers` (no sitecustomize): the
training bench runs its peer rows with `PYTHONPATH=/tmp/peers` (`--peer-site`). The bench set installs as
  cd .carry/bench && pip install ... --target /tmp/site $(cat site.txt) &&
    pip install ... --target /tmp/peers $(cat peers.txt)
benchmarks/README.md has the commands of each committed proof.

    python benchmarks/carry_sets.py               # all of them
    python benchmarks/carry_sets.py core ray      # some
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "device"
CARRY = REPO / ".carry"
# what the core set brings (the image has torch, accelerate, peft, triton, numpy, pyarrow, ...)
CORE = ["prefect", "datasets", "kernels", "bitsandbytes", "transformers", "liger-kernel"]
# what the training bench and its workers import of the core set (no Prefect)
BENCH = ["datasets", "kernels", "bitsandbytes", "transformers", "liger-kernel", "pydantic"]
# entries of the ray wheel that nothing here uses: the Java workers' jar, RLlib, the dashboard's source maps
RAY_DROP = re.compile(r"^ray/(jars/|rllib/)|\.map$")
# the training bench's peers, at the newest versions that run on the image's torch 2.11 and transformers 5.17
PEERS = ["unsloth==2026.10.9", "unsloth-zoo==2026.10.9", "trl==1.15.0"]
# what they list but these runs do without: xformers (PyPI's wheels are built for another torch; Unsloth uses PyTorch's
# attention without it), diffusers (image models only)
PEERS_SKIP = ["xformers", "diffusers"]
# Unsloth Studio's web app and its back end (60 MiB of the wheel's 85): not the library
UNSLOTH_DROP = re.compile(r"^studio/")
PEERS_LIMIT_MIB = 60


def pins() -> dict[str, str]:
    """`name -> requirement` for every pinned dependency and extra in pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {re.split(r"[\[=<>!~ ]", r, maxsplit=1)[0].lower(): r for r in reqs}


def bundle(out: Path, reqs: list[str], limit_mib: int, **env: str) -> None:
    script = SHARED / "make-wheel-bundle.sh"
    if not script.is_file():
        raise SystemExit(f"{script} not found: these sets are built beside the project's shared device tools")
    subprocess.run(["bash", str(script), str(out), *reqs], check=True,
                   env={**os.environ, "LIMIT_MIB": str(limit_mib), **env})
    for extra in out.glob("_*.tsv"):  # the bundle script's notes, not wheels
        extra.unlink()


def slim_wheel(wheel: Path, drop: re.Pattern) -> Path:
    """The wheel without the entries `drop` matches, its RECORD rewritten to match (pip checks it)."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        # the wheel's own RECORD, at the top level (ray vendors packages with dist-info folders of their own)
        record_name = next(n for n in src.namelist() if re.fullmatch(r"[^/]+\.dist-info/RECORD", n))
        kept = [i for i in src.infolist() if not drop.search(i.filename) and i.filename != record_name]
        lines = []
        for info in kept:
            data = src.read(info)
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{info.filename},sha256={digest},{len(data)}")
        dst.writestr(record_name, "\n".join(lines + [f"{record_name},,"]) + "\n")
    slim.replace(wheel)
    return wheel


def build_core(pinned: dict[str, str]) -> None:
    bundle(CARRY / "core", [pinned[n] for n in CORE], 62, NODEPS="kernels")


def build_ray(pinned: dict[str, str]) -> None:
    out = CARRY / "ray"
    with tempfile.TemporaryDirectory() as tmp:
        # ray alone: its dependencies are on the image or in the core set (the bundle script lists them)
        bundle(Path(tmp), [pinned["ray"].replace("ray[train]", "ray")], 100, NODEPS="ray")
        wheel = next(Path(tmp).glob("ray-*.whl"))
        slim_wheel(wheel, RAY_DROP)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.move(wheel, out / wheel.name)
    print(f"{out}: {sum(p.stat().st_size for p in out.iterdir()) / 2**20:.1f} MiB")


def image_packages() -> str:
    """The bundle script's list of what the device image already has (`name` or `name==version` a line)."""
    text = (SHARED / "make-wheel-bundle.sh").read_text()
    return text.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0] + "\n"


def peers_wheels(pinned: dict[str, str], wheels: Path) -> float:
    """The peers' wheels into `wheels`; their MiB."""
    with tempfile.TemporaryDirectory() as tmp:
        exclude = Path(tmp) / "image.txt"
        exclude.write_text(image_packages() + "\n".join(PEERS_SKIP) + "\n")
        # bitsandbytes, liger-kernel and pydantic as the core set pins them: this site must not need core's
        bundle(wheels, [*PEERS, pinned["bitsandbytes"], pinned["liger-kernel"], pinned["pydantic"]], 200,
               EXCLUDE_FILE=str(exclude))
    slim_wheel(next(wheels.glob("unsloth-*.whl")), UNSLOTH_DROP)
    return sum(p.stat().st_size for p in wheels.glob("*.whl")) / 2**20


def build_peers(pinned: dict[str, str]) -> None:
    out = CARRY / "peers"
    with tempfile.TemporaryDirectory() as tmp:
        mib = peers_wheels(pinned, Path(tmp) / "wheels")
        if mib > PEERS_LIMIT_MIB:
            raise SystemExit(f"{out}: {mib:.1f} MiB, over the {PEERS_LIMIT_MIB} MiB one call carries beside the tree")
        shutil.rmtree(out, ignore_errors=True)
        shutil.move(Path(tmp) / "wheels", out)
    print(f"{out}: {mib:.1f} MiB")


def build_bench(pinned: dict[str, str]) -> None:
    out = CARRY / "bench"
    with tempfile.TemporaryDirectory() as tmp:
        site, peers, merged = Path(tmp) / "site", Path(tmp) / "peers", Path(tmp) / "bench"
        bundle(site, [pinned[n] for n in BENCH], 200, NODEPS="kernels")
        peers_wheels(pinned, peers)
        merged.mkdir()
        for part in (site, peers):
            names = sorted(p.name for p in part.glob("*.whl"))
            for name in names:  # a wheel both sites use has one file name and the same bytes: kept once
                if not (merged / name).exists():
                    shutil.copy2(part / name, merged / name)
            (merged / f"{part.name}.txt").write_text("\n".join(names) + "\n")
        mib = sum(p.stat().st_size for p in merged.glob("*.whl")) / 2**20
        if mib > PEERS_LIMIT_MIB:
            raise SystemExit(f"{out}: {mib:.1f} MiB, over the {PEERS_LIMIT_MIB} MiB one call carries beside the tree")
        shutil.rmtree(out, ignore_errors=True)
        shutil.move(merged, out)
    print(f"{out}: {mib:.1f} MiB")


def build_fa4(pinned: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        bundle(Path(tmp), [pinned["flash-attn-4"]], 250, PRE="1")
        subprocess.run(["bash", str(SHARED / "stage-for-carry.sh"), tmp, str(CARRY / "fa4")], check=True)


def main() -> int:
    builders = {"core": build_core, "ray": build_ray, "fa4": build_fa4, "peers": build_peers, "bench": build_bench}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", nargs="*", metavar="SET", help=f"any of {', '.join(builders)} (default: all)")
    names = parser.parse_args().sets or list(builders)
    unknown = sorted(set(names) - set(builders))
    if unknown:
        parser.error(f"unknown set(s) {', '.join(unknown)}: choose from {', '.join(builders)}")
    pinned = pins()
    for name in names:
        print(f"== {name}", flush=True)
        builders[name](pinned)
    return 0


if __name__ == "__main__":
    sys.exit(main())
