"""The JAX coordination service of each group generation, hosted by the controller, and the ports it takes."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from elastic_runtime.cluster.config import LaunchError

__all__ = ["ENV_SIMULATED", "free_port", "host_service", "start_coordination_service"]

log = logging.getLogger(__name__)

# Set to "1" only for groups of simulated workers (``tests/multiprocess/simworkers.py``), which run no JAX: the
# controller then hosts no coordination service for them. Nothing on the real path sets it.
ENV_SIMULATED = "ELASTIC_SIMULATED_WORKERS"


class _NoService:
    """What stands for a coordination service in a simulated group."""

    def shutdown(self) -> None:
        pass


def free_port(host: str = "127.0.0.1", ports: tuple[int, int] | None = None) -> int:
    """A TCP port that was free on ``host`` a moment ago: any, or the first free one in ``ports`` (low, high).

    Raises:
        OSError: every port of ``ports`` is taken.
    """
    candidates = range(ports[0], ports[1] + 1) if ports is not None else [0]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in candidates:
        with socket.socket(family) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            free: int = sock.getsockname()[1]
            return free
    raise OSError(f"no free port on {host} in {ports[0]}-{ports[1]}" if ports else f"no free port on {host}")


def start_coordination_service(host: str, port: int, num_processes: int, *, heartbeat_timeout_s: int = 30) -> Any:
    """Start a JAX coordination service for one generation of the group, here in the controller, on ``host:port``.

    JAX normally runs it inside process 0, whose loss then ends every other worker (their clients poll an
    error and terminate). Hosted by the controller, which is never restarted, it outlives any worker.
    ``recoverable``: a task that disappears is not an error for the others. It is not authenticated (JAX
    has no such option for it): keep its ports on a private network.
    """
    from elastic_runtime.compat import jax as jax_compat

    return jax_compat.distributed_runtime_service(
        f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        num_processes,
        heartbeat_timeout=heartbeat_timeout_s,
        shutdown_timeout=2,
        recoverable=True,
    )


def host_service(
    host: str, num_processes: int, generation: int, ports: tuple[int, int] | None = None
) -> tuple[int, Any]:
    """Generation ``generation``'s coordination service on a free port of ``host`` (in ``ports``, if given);
    another port if the chosen one was taken meanwhile.

    Raises:
        LaunchError: no port is free, or the service did not start in a few attempts.
    """
    if os.environ.get(ENV_SIMULATED) == "1":
        return 0, _NoService()
    attempts = 5
    for attempt in range(attempts):
        try:
            port = free_port(host, ports)
        except OSError as exc:
            raise LaunchError(f"cannot host generation {generation}'s coordination service: {exc}") from exc
        try:
            return port, start_coordination_service(host, port, num_processes)
        except Exception as exc:  # port taken between free_port() and the bind (shared machine)
            log.warning("coordination service on port %d failed (attempt %d): %s", port, attempt + 1, exc)
    raise LaunchError(f"could not start a coordination service in {attempts} attempts")
