"""The RAM tier: a host-memory copy of the training state, taken asynchronously and double-buffered.

``capture`` starts the device-to-host copy of every addressable shard and returns; a background thread
finishes it into the buffer that is not the committed one, then swaps. The committed snapshot is therefore
always complete: a failure mid-copy leaves the previous one in place. At most one copy is in flight; a
capture that finds one still running waits for it. Buffers are never reused: a snapshot handed to a reader
(a slower tier writing it out) stays valid for as long as the reader holds it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from runtime.errors import SnapshotUnavailable

log = logging.getLogger(__name__)

PyTree = Any


@dataclass(frozen=True)
class HostSnapshot:
    """The state after ``step`` in host memory, with the data position needed to resume exactly."""

    step: int
    data_position: int
    tree: PyTree  # numpy arrays, same structure as the training state
    nbytes: int
    seconds: float  # from capture() to the copy being complete
    metadata: dict[str, Any]


def _copy_into(leaf: Any, buffer: np.ndarray) -> None:
    if not isinstance(leaf, jax.Array):
        np.copyto(buffer, np.asarray(leaf))
        return
    for shard in leaf.addressable_shards:
        if shard.replica_id == 0:  # each piece once, however often it is replicated
            buffer[shard.index] = np.asarray(shard.data)


def _start_transfers(leaves: list[Any]) -> None:
    """Start the device-to-host DMA of each distinct shard, so the copy thread only waits for it.

    CPU devices already live in host memory: there an early transfer is only an extra copy, skipped.
    """
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and next(iter(leaf.devices())).platform != "cpu":
            for shard in leaf.addressable_shards:
                if shard.replica_id == 0:
                    shard.data.copy_to_host_async()


class RamTier:
    """Keeps the newest complete host copy of the state.

    Args:
        every: take a snapshot every ``every`` committed steps (1: every step).

    ``listeners`` are called from the copy thread with each completed snapshot (keep them short: hand the
    snapshot to your own thread or queue); ``failure_listeners`` with the step and error of a failed copy.
    """

    name = "ram"

    def __init__(self, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"snapshot cadence must be >= 1 step, got {every}")
        self.every = every
        self.listeners: list[Callable[[HostSnapshot], None]] = []
        self.failure_listeners: list[Callable[[int, BaseException], None]] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ram-snapshot")
        self._lock = threading.Lock()
        self._committed: HostSnapshot | None = None
        self._in_flight: Future[HostSnapshot] | None = None
        self._in_flight_step = 0

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def capture(self, state: PyTree, *, step: int, data_position: int, metadata: dict[str, Any]) -> None:
        """Start copying ``state`` (device arrays) to host memory. Blocks only if a copy is in flight.

        Never raises: a copy that fails (its arrays were lost with a device) is reported to
        ``failure_listeners`` and the previous snapshot stays the committed one.
        """
        self.wait()
        started = time.monotonic()
        leaves, treedef = jax.tree.flatten(state)

        def finish() -> HostSnapshot:
            buffers = [np.empty(np.shape(leaf), dtype=leaf.dtype) for leaf in leaves]
            for leaf, buffer in zip(leaves, buffers, strict=True):
                _copy_into(leaf, buffer)
            snapshot = HostSnapshot(
                step=step,
                data_position=data_position,
                tree=jax.tree.unflatten(treedef, buffers),
                nbytes=sum(b.nbytes for b in buffers),
                seconds=time.monotonic() - started,
                metadata=dict(metadata),
            )
            with self._lock:
                self._committed = snapshot
            for listener in self.listeners:
                listener(snapshot)
            return snapshot

        try:
            _start_transfers(leaves)
        except Exception as exc:
            self._report(step, exc)
            return
        self._in_flight = self._pool.submit(finish)
        self._in_flight_step = step

    def _report(self, step: int, exc: BaseException) -> None:
        log.error("RAM snapshot of step %d failed: %s: %s", step, type(exc).__name__, exc)
        for listener in self.failure_listeners:
            listener(step, exc)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the copy in flight, if any. A failed copy is logged; the previous snapshot stays."""
        future = self._in_flight
        if future is None:
            return
        try:
            future.result(timeout=timeout)
        except TimeoutError:
            raise
        except Exception as exc:  # the copy failed: the committed snapshot is still the previous one
            self._report(self._in_flight_step, exc)
        self._in_flight = None

    def latest(self, like: PyTree = None, timeout: float | None = 30.0) -> HostSnapshot:
        """The newest complete snapshot, after the copy in flight (if any) has finished.

        ``like`` (the state's structure) is accepted for the restore-source protocol; RAM needs no template.

        Raises:
            SnapshotUnavailable: no snapshot has completed yet.
        """
        self.wait(timeout)
        with self._lock:
            snapshot = self._committed
        if snapshot is None:
            raise SnapshotUnavailable("the RAM tier holds no snapshot yet")
        return snapshot

    def close(self) -> None:
        self._pool.shutdown(wait=True)
