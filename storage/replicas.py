"""Replicas for multi-process runs: a full host copy of the state in every worker, shared by broadcast.

In the multi-process layout the state is sharded over the devices *inside* a process and replicated across
processes (the ``data`` axis spans processes), so every worker holds a complete copy: each is its
neighbours' replica, and losing any one worker loses no committed step. A re-formed group restores by
broadcasting the newest copy from one member (:func:`broadcast_state`), which is how a replacement worker
takes its shards from its peers.

:class:`ReplicaFiles` keeps the same copy in files, one folder per process, under ``/dev/shm`` by default
(survives the loss of every worker process, not of the host) or any directory, in the disk tier's format:
Orbax's layout with a manifest that lists every file's size and CRC32C, committed last, so a kill mid-write
leaves the previous replica whole and a damaged one is detected on read. No pickle.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from runtime.core.errors import SnapshotUnavailable, StorageError
from runtime.core.restore import restore_newest
from runtime.core.snapshot import HostSnapshot
from storage.disk import DiskTier

log = logging.getLogger(__name__)

_TIMEOUT_S = 120.0  # one replica write or read; /dev/shm is memory

PyTree = Any


def replica(step: int, data_position: int, tree: PyTree) -> HostSnapshot:
    """A worker's replica: the state after ``step`` as host arrays, with the data position to resume exactly."""
    nbytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tree))
    return HostSnapshot(step=step, data_position=data_position, tree=tree, nbytes=nbytes, seconds=0.0, metadata={})


def host_copy(tree: PyTree) -> PyTree:
    """Copy ``tree``'s arrays to host memory from this process's addressable shards.

    Unlike the single-process RAM tier (which copies ``replica_id == 0`` shards, some of which live on other
    processes here), every local shard is copied, so the copy is complete whenever this process holds the
    whole array, as it does when the state is replicated across processes.

    Raises:
        SnapshotUnavailable: this process does not hold every element of some array.
    """

    def one(leaf: Any) -> np.ndarray:
        if not isinstance(leaf, jax.Array):
            return np.array(leaf)
        out = np.empty(leaf.shape, leaf.dtype)
        covered = np.zeros(leaf.shape, bool) if leaf.ndim else None
        for shard in leaf.addressable_shards:
            out[shard.index] = np.asarray(shard.data)
            if covered is not None:
                covered[shard.index] = True
        if covered is not None and not covered.all():
            raise SnapshotUnavailable(
                f"process {jax.process_index()} holds only part of an array of shape {leaf.shape}; "
                "peer replicas need the state replicated across processes"
            )
        return out

    return jax.tree.map(one, tree)


def broadcast_state(tree: PyTree, *, is_source: bool) -> PyTree:
    """Every process gets the source's ``tree`` (host arrays of the same structure everywhere).

    A collective over the current ``jax.distributed`` group: every member must call it, exactly one with
    ``is_source``. Non-sources pass any tree of the right shapes and dtypes (their values are ignored).
    """
    from jax.experimental import multihost_utils

    result: PyTree = multihost_utils.broadcast_one_to_all(tree, is_source=is_source)
    return jax.tree.map(np.asarray, result)


class ReplicaFiles:
    """This process's newest replica on its host, in the disk tier's format (a manifest with the CRC32C of
    every file, committed last), written in the background; ``newest`` reads any process's, verified.

    Args:
        directory: where the replicas of every process live (``/dev/shm/...`` to survive process restarts
            on this host); each process has a folder of its own in it.
        name: this process's folder (stable across its restarts, e.g. ``worker-0``).
        keep: replicas kept per process (the newest ones; two, so a crash mid-write leaves one whole).
    """

    def __init__(self, directory: str | os.PathLike[str], name: str, *, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.tier = DiskTier(self.directory / name, name="shm", check_space=False)
        self.keep = keep
        for torn in self.tier.sweep():  # an earlier process of this name was killed mid-write
            log.info("removed a torn replica: %s", torn)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-file")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()

    @property
    def on_write(self) -> list[Callable[[int], None]]:
        """Called with the step mid-write (its files written, not yet committed), in the writer thread."""
        return self.tier.before_commit

    def save(self, snapshot: HostSnapshot) -> None:
        """Start writing ``snapshot``, after the previous write finished (so no committed step is skipped)."""
        self.wait()
        with self._lock:
            self._pending = self._pool.submit(self._write, snapshot)

    def _write(self, snapshot: HostSnapshot) -> None:
        started = time.monotonic()
        self.tier.save(snapshot, timeout=_TIMEOUT_S)
        for info in self.tier.list(timeout=_TIMEOUT_S)[self.keep :]:
            self.tier.delete(info.step, timeout=_TIMEOUT_S)
        log.debug("replica of step %d written in %.3f s", snapshot.step, time.monotonic() - started)

    def wait(self) -> None:
        with self._lock:
            pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except StorageError as exc:  # a failed write leaves the previous replica; training goes on
                log.error("replica write failed: %s", exc)

    def newest(self, like: PyTree) -> HostSnapshot:
        """The newest replica of any process here that verifies and has the structure of ``like``.

        Raises:
            SnapshotUnavailable: none does.
        """
        folders = sorted(p for p in self.directory.iterdir() if p.is_dir()) if self.directory.is_dir() else []
        tiers = [DiskTier(folder, name="shm", check_space=False) for folder in folders]
        try:
            return restore_newest(tiers, like, timeout=_TIMEOUT_S)[1]
        except SnapshotUnavailable as exc:
            raise SnapshotUnavailable(f"no usable replica in {self.directory}: {exc}") from exc

    def close(self) -> None:
        self._pool.shutdown(wait=True)
