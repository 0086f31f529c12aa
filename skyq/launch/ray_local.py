"""The embedded run's local Ray cluster, bound to loopback.

Ray 2.60 decides what its processes listen on from the node's IP: a node whose IP is 127.0.0.1
starts the GCS, the raylet, the runtime-env agent and every worker's gRPC server on 127.0.0.1;
any other IP makes them listen on every interface. `ray.init(_node_ip_address="127.0.0.1")` alone
is not enough: on Linux Ray replaces a loopback address by the machine's routable one
(`services.resolve_ip_for_localhost`), unless `ray_constants.ENABLE_RAY_CLUSTER` is false, the
setting Ray itself uses on macOS and Windows, where local clusters stay on loopback. So the
cluster is started with that setting off; the test of the listening sockets
(tests/launch/test_ray_cluster.py) catches a Ray version where this stops working.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

LOOPBACK = "127.0.0.1"


def startup_line(text: str) -> None:
    """One line of start-up progress (what the run is doing while it prints nothing else)."""
    print(f"start-up: {text}", flush=True)


@contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[None]:
    """Start a loopback-only local Ray for the run unless the caller already has one (tests, a
    sweep); stop what we start."""
    import ray

    if ray.is_initialized():
        yield
        return
    startup_line(f"starting Ray (local cluster on {LOOPBACK})")
    start = time.perf_counter()
    with _loopback_node():
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            namespace="skyq",
            _node_ip_address=LOOPBACK,
        )
    startup_line(f"Ray up in {time.perf_counter() - start:.1f} s")
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def _loopback_node() -> Iterator[None]:
    """Keep Ray from turning the node's loopback address into a routable one while it starts."""
    import ray
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        raise RuntimeError(
            f"Ray {ray.__version__} has no ray_constants.ENABLE_RAY_CLUSTER: skyq cannot bind its local cluster "
            "to loopback with this Ray version (tested with Ray 2.60)"
        )
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
