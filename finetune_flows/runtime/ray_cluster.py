"""`hardware.launcher: ray`: the cluster checked before a run and before Ray Train starts its workers.

`ray.init` retries an address nothing answers at for good (the run holding its device slot), and Ray Train waits for
good for workers a cluster has no CPUs or GPUs for: both are one message here instead, the first before anything
loads.
"""

from __future__ import annotations

import socket

CONNECT_SECONDS = 5.0


def head_address(address: str) -> str | None:
    """`hardware.ray_address` as host:port (`auto`: the cluster this host joined, as `ray.init` finds it: RAY_ADDRESS
    or the address `ray start` left in Ray's temporary directory); None where `auto` finds no cluster."""
    if address.startswith("ray://"):
        return address.removeprefix("ray://")
    if address != "auto":
        return address
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:  # Ray moved its resolution: ray.init reports what it finds
        return address
    try:
        return canonicalize_bootstrap_address("auto")
    except ConnectionError:
        return None


def ray_problems(cfg) -> list[str]:
    """The Ray head the run would connect to, reachable (a TCP connection, within CONNECT_SECONDS)."""
    h = cfg.hardware
    if h.launcher != "ray":
        return []
    try:
        address = head_address(h.ray_address)
    except ValueError as exc:
        return [f"hardware.ray_address={h.ray_address}: {exc}"]
    if address is None:
        return ["hardware.ray_address=auto: this host has joined no Ray cluster (no RAY_ADDRESS, and no running "
                "cluster left by `ray start`): start one (`ray start --head`) or name the head's host:port"]
    if address == "auto":
        return []
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except (OSError, ValueError) as exc:
        return [f"hardware.ray_address={h.ray_address}: no Ray head answers at {address} ({exc})"]
    return []


def cluster_fits(workers: int, resources: dict[str, float], on_gpu: bool, address: str) -> None:
    """Ray Train waits for good for workers the cluster cannot place: refuse a run that needs more GPUs (or CPUs)
    than the whole cluster has."""
    kind = "GPU" if on_gpu else "CPU"
    have = resources.get(kind, 0)
    if have < workers:
        from finetune_flows.errors import EnvironmentMismatch

        raise EnvironmentMismatch([f"hardware.nodes x hardware.gpus_per_node = {workers} training workers, one {kind} "
                                   f"each, but the Ray cluster at {address} has {have:g} {kind}(s) in all; lower "
                                   "hardware.nodes or add nodes to the cluster"], "config vs the Ray cluster")
