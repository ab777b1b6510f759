"""Ray's side of ``launch --backend ray``: connecting the driver to a cluster (:func:`ray_session`), and a
multi-node cluster on this machine for ``launch --backend ray`` without ``--ray-address`` and for the tests
(:func:`local_cluster`, :func:`add_node`). Placing the workers is ``ray_backend.py``'s.

``ray`` is imported only when one of these is called (``pip install elastic-runtime[ray]``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from elastic_runtime.cluster.controller.state import is_loopback

__all__ = ["add_node", "local_cluster", "ray_module", "ray_session"]

log = logging.getLogger(__name__)

_OBJECT_STORE_BYTES = 100 * 1024 * 1024  # per node of a local cluster: the workers put nothing in it
# Ray turns a loopback address into the machine's own before it connects ("so that other nodes can reach it"),
# unless multi-node clusters are off, which on Linux changes nothing else: set for loopback clusters only.
_ENV_LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ray_module() -> Any:
    """``ray``, imported on first use (the core runs without it), and typed loosely."""
    import ray

    return ray


def _keep_loopback() -> None:
    """Keep Ray's loopback addresses loopback, in this process and the nodes it starts."""
    os.environ[_ENV_LOOPBACK] = "0"
    import ray._private.ray_constants as constants  # read when this process connects, if imported already

    constants.ENABLE_RAY_CLUSTER = False


def _is_loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``, or a host alone) is this machine's loopback."""
    return is_loopback(address.rpartition(":")[0].strip("[]") or address)


_START_ATTEMPTS = 3
_SLOW_START = ("timed out during startup", "Timed out waiting for file")  # Ray's words for the two


def _slow_start(exc: BaseException) -> bool:
    return any(slow in str(exc) for slow in _SLOW_START)


def _started(what: str, start: Callable[[], Any]) -> Any:
    """``start()``, tried again when Ray gave up waiting for it: Ray gives a raylet 30 s to register and its GCS
    server 30 s to write its port's file, and on a busy machine each once did not (the whole suite on 2 cores).
    Each try is on new ports; the last failure is raised."""

    def again(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome else None
        log.warning("%s did not start (attempt %d): %s; trying again", what, state.attempt_number, error)

    retrying = Retrying(
        stop=stop_after_attempt(_START_ATTEMPTS),
        retry=retry_if_exception(_slow_start),
        before_sleep=again,
        reraise=True,
    )
    return retrying(start)


@contextlib.contextmanager
def local_cluster(nodes: int, *, cpus_per_node: int = 1) -> Iterator[Any]:
    """A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), every process on 127.0.0.1:
    a head without CPUs (the driver's: the controller runs there) and ``nodes`` worker nodes of
    ``cpus_per_node`` CPUs and a 100 MB object store each. Shut down on the way out.

    Raises:
        RuntimeError (Ray's own errors, unwrapped): Ray cannot start.
    """
    _keep_loopback()
    # Ray's usage reporting sends to usage-stats.ray.io from the head's dashboard: a cluster on loopback reaches no
    # other address (a user may still opt in through the variable).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    head = {
        "num_cpus": 0,
        "include_dashboard": False,
        "object_store_memory": _OBJECT_STORE_BYTES,
        "node_ip_address": "127.0.0.1",
    }
    cluster = _started("the Ray head", lambda: Cluster(initialize_head=True, head_node_args=head))
    try:
        for _ in range(nodes):
            add_node(cluster, cpus=cpus_per_node)
        yield cluster
    finally:
        cluster.shutdown()


def add_node(cluster: Any, *, cpus: int = 1) -> Any:
    """Add a worker node to a :func:`local_cluster` (127.0.0.1, ``cpus`` CPUs, a 100 MB object store); one Ray
    gave up waiting for is started again, as the head is."""
    return _started(
        "a Ray node",
        lambda: cluster.add_node(num_cpus=cpus, object_store_memory=_OBJECT_STORE_BYTES, node_ip_address="127.0.0.1"),
    )


@contextlib.contextmanager
def ray_session(address: str) -> Iterator[str]:
    """Connect this process to the Ray cluster at ``address`` as its driver; yields the address of this node,
    where the controller listens. Disconnected on the way out."""
    loopback = _is_loopback(address)
    if loopback:
        _keep_loopback()
    ray = ray_module()
    ray.init(
        address=address,
        namespace="elastic-runtime",
        log_to_driver=False,
        logging_level=logging.WARNING,
        **({"_node_ip_address": "127.0.0.1"} if loopback else {}),
    )
    try:
        yield "127.0.0.1" if loopback else str(ray.util.get_node_ip_address())
    finally:
        ray.shutdown()
