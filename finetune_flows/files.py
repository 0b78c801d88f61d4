"""Writes that readers see whole or not at all: the one way the engine, the tasks and the benchmarks write a file
that marks something done (a worker's result, a checkpoint's manifest, a store entry, a report)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary name beside `path`, fsync, and rename into place: readers see all or nothing, and a
    process killed mid-write leaves the former file (or none), never a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


def write_json(path: Path, data: Any, **dumps: Any) -> None:
    """`data` as JSON (indented by 2 unless `dumps` says otherwise), written with write_atomic."""
    write_atomic(path, json.dumps(data, **{"indent": 2, **dumps}))
