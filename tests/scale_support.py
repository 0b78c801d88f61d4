"""Shared by the scale-out test files (the 2-rank reference run they compare with is a conftest fixture)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_same_curve(got, want) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    for (step, a), (_, b) in zip(got, want):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (step, got, want)  # fp32, same data order and seed
