"""`hardware.launcher: ray`: the cluster checked before a run and before Ray Train starts its workers.

`ray.init` retries an address nothing answers at for good (the run holding its device slot), and Ray Train waits for
good for workers a cluster has no CPUs or GPUs for: both are one message here instead, the first before anything
loads. The head is asked a question only a Ray head answers (its cluster id; for `ray://`, the Ray Client server's
ping): a port that merely accepts connections (the dashboard's 8265, the client port without `ray://`, a proxy)
would otherwise pass, and `ray.init` fail after the model was loaded.
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
    if not host or not port.isdigit():
        return [f"hardware.ray_address={h.ray_address}: not an address Ray connects to: name the head as host:port "
                "(`ray start --head` prints it; 6379 unless --port), `ray://host:10001`, or `auto`"]
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        return [f"hardware.ray_address={h.ray_address}: no Ray head answers at {address} ({exc})"]
    problem = head_answers(address, h.ray_address.startswith("ray://"))
    return [f"hardware.ray_address={h.ray_address}: {problem}"] if problem else []


def head_answers(address: str, client: bool) -> str | None:
    """None where a Ray head's GCS (or, for `ray://`, a Ray Client server) answers at host:port within
    CONNECT_SECONDS; else what answered instead."""
    try:
        import grpc
        from ray._private.grpc_utils import init_grpc_channel  # TLS and token auth as Ray's own clients
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, ray_client_pb2, ray_client_pb2_grpc
    except ImportError:  # Ray moved its internals: ray.init reports what it finds
        return None
    with init_grpc_channel(address) as channel:
        try:
            if client:
                ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
                    ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING),
                    timeout=CONNECT_SECONDS)
            else:
                gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                    gcs_service_pb2.GetClusterIdRequest(), timeout=CONNECT_SECONDS)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:  # a head that wants a token this host does not send
                return (f"the Ray head at {address} refuses this host's credentials ({exc.details()}): it was "
                        "started with token authentication; where the flow runs set RAY_AUTH_MODE=token and the "
                        "cluster's token (~/.ray/auth_token, or RAY_AUTH_TOKEN)")
            what = ("a Ray Client server (`ray://`)" if client
                    else "a Ray head's GCS port (what `ray start --head` prints)")
            return (f"something accepts connections at {address}, but it is not {what}: "
                    f"{exc.code().name}: {exc.details()}")
    return None


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


def state_api_problem(address: str) -> str | None:
    """In the connected driver: whether the cluster serves Ray's State API (its head's dashboard). Without it (a
    head started by `ray start` where only ray[train] is installed, as `.[ray]` installs), Ray Train's detached
    PlacementGroupCleaner cannot see its controller: it logs a warning every second of the run, and after a stopped
    run it stays on the head for good."""
    if address.startswith("ray://"):  # a Ray Client connection: the state API is the server's business
        return None
    import ray
    from ray.util.state import list_nodes
    from ray.util.state.exception import RayStateApiException

    try:
        list_nodes(address=ray.get_runtime_context().gcs_address, limit=1, timeout=CONNECT_SECONDS,
                   raise_on_missing_output=False)
    except RayStateApiException:
        return (f"the Ray cluster at {address} serves no State API (its head runs the dashboard in minimal mode: "
                "ray[default] is not installed where `ray start --head` ran), so Ray Train logs 'Failed to query "
                "Ray Train Controller actor state' every second and a stopped run leaves a PlacementGroupCleaner "
                "actor on the head; install 'ray[default]==2.60.0' there and restart the head")
    return None
