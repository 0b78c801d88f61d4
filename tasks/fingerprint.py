"""Content fingerprints for cache keys: what truly determines a step's output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

_PROJECT = Path(__file__).resolve().parent


def hash_bytes_of(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path.name).encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def hash_tree(root: Path, suffixes: tuple[str, ...] | None = None) -> str:
    """Hash every file under root (names and bytes), optionally only those with given suffixes."""
    files = sorted(p for p in Path(root).rglob("*") if p.is_file() and (suffixes is None or p.suffix in suffixes))
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(root)).encode())
        h.update(hash_bytes_of([p]).encode())
    return h.hexdigest()


def code_version(*modules: str) -> str:
    """Hash of the source of the given `tasks` modules, so a code change invalidates the steps it affects."""
    return hash_bytes_of([_PROJECT / f"{m}.py" for m in sorted(modules)])[:16]


def combine(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
