"""What is installed: a distribution's version from its metadata, without importing it (importing Triton, Liger or
bitsandbytes initialises CUDA libraries, and a version check must not)."""

from __future__ import annotations

import importlib.metadata


def installed_version(dist: str) -> str | None:
    """The installed version of the PyPI distribution `dist` ("liger-kernel", not "liger_kernel"), None if absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
