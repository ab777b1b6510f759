"""The JAX coordination service of each group generation, hosted by the controller, and the ports it takes."""

from __future__ import annotations

import socket
from typing import Any

__all__ = ["free_port", "start_coordination_service"]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def start_coordination_service(port: int, num_processes: int, *, heartbeat_timeout_s: int = 30) -> Any:
    """Start a JAX coordination service for one generation of the group, here in the controller.

    JAX normally runs it inside process 0, whose loss then ends every other worker (their clients poll an
    error and terminate). Hosted by the controller, which is never restarted, it outlives any worker.
    ``recoverable``: a task that disappears is not an error for the others.
    """
    from runtime.compat import jax as jax_compat

    return jax_compat.distributed_runtime_service(
        f"127.0.0.1:{port}",
        num_processes,
        heartbeat_timeout=heartbeat_timeout_s,
        shutdown_timeout=2,
        recoverable=True,
    )
