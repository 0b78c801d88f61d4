"""Training checkpoints: a manifest written after each one, so a checkpoint half-written by a crash is never
resumed from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from finetune_flows.files import write_json

CHECKPOINT_MANIFEST = "finetune-flows-checkpoint.json"


def write_checkpoint_manifest(path: Path) -> None:
    """Written after the Trainer finished a checkpoint: the name and size of every file in it, atomically."""
    files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*"))
             if p.is_file() and p.name != CHECKPOINT_MANIFEST}
    write_json(path / CHECKPOINT_MANIFEST, {"files": files}, indent=None)


def rotate_checkpoints(ckpt_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints (train.save_total_limit), once the newest has its manifest. The
    Trainer's own rotation runs before that manifest is written: with one kept, a kill in between left none complete."""
    found = sorted((p for p in ckpt_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]))
    for old in found[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_is_complete(path: Path) -> bool:
    try:
        files = json.loads((path / CHECKPOINT_MANIFEST).read_text())["files"]
        json.loads((path / "trainer_state.json").read_text())
        return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def last_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest *complete* checkpoint (its manifest lists files that are all there, at their sizes). A crash
    during a save, or a file lost later, leaves one that is not; those are removed so the Trainer can write that
    step again, and the previous checkpoint is used."""
    if not ckpt_dir.is_dir():
        return None
    candidates = sorted((p for p in ckpt_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                        key=lambda p: int(p.name.split("-")[-1]), reverse=True)
    for path in candidates:
        if checkpoint_is_complete(path):
            return path
        print(f"removing incomplete checkpoint {path.name} (interrupted while saving, or a file is missing)",
              flush=True)
        shutil.rmtree(path, ignore_errors=True)
    return None
