"""Replicas for multi-process runs: a full host copy of the state in every worker, shared by broadcast.

In the multi-process layout the state is sharded over the devices *inside* a process and replicated across
processes (the ``data`` axis spans processes), so every worker holds a complete copy: each is its
neighbours' replica, and losing any one worker loses no committed step. A re-formed group restores by
broadcasting the newest copy from one member (:func:`broadcast_state`), which is how a replacement worker
takes its shards from its peers.

:class:`ReplicaFiles` keeps the same copy in files, one per process, under ``/dev/shm`` by default (survives
the loss of every worker process, not of the host) or any directory (a disk tier for full restarts).
Files are written to a temporary name and renamed, so a kill mid-write leaves the previous file intact.
No pickle: ``np.load(allow_pickle=False)``.
"""

from __future__ import annotations

import json
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

from runtime.core.errors import SnapshotUnavailable
from runtime.core.snapshot import HostSnapshot

log = logging.getLogger(__name__)

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
    """One file per process with its newest replica, written in the background, newest-wins on read.

    Args:
        directory: where the files live (``/dev/shm/...`` to survive process restarts on this host).
        name: this process's file name (stable across its restarts, e.g. ``rank-0``).
    """

    def __init__(self, directory: str | os.PathLike[str], name: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{name}.npz"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-file")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self.on_write: list[Callable[[int], None]] = []  # called with the step mid-write, in the writer thread

    def save(self, snapshot: HostSnapshot) -> None:
        """Start writing ``replica``, after the previous write finished (so no committed step is skipped)."""
        self.wait()
        with self._lock:
            self._pending = self._pool.submit(self._write, snapshot)

    def _write(self, snapshot: HostSnapshot) -> None:
        started = time.monotonic()
        leaves = jax.tree.leaves(snapshot.tree)
        meta = json.dumps({"step": snapshot.step, "data_position": snapshot.data_position, "leaves": len(leaves)})
        tmp = self.path.with_suffix(f".tmp{os.getpid()}.npz")
        arrays: dict[str, Any] = {f"leaf{i}": leaf for i, leaf in enumerate(leaves)}
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(meta.encode(), np.uint8), **arrays)
            f.flush()
            for hook in self.on_write:
                hook(snapshot.step)
        os.replace(tmp, self.path)  # atomic: readers see the old file or the new one, never half of one
        log.debug("replica file step %d written in %.3f s", snapshot.step, time.monotonic() - started)

    def wait(self) -> None:
        with self._lock:
            pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except OSError as exc:  # a failed write leaves the previous file; training goes on
                log.error("replica file write failed: %s", exc)

    def newest(self, like: PyTree) -> HostSnapshot:
        """The newest readable replica in the directory (any process's file) with the structure of ``like``.

        Raises:
            SnapshotUnavailable: no file holds a usable replica.
        """
        leaves_like, treedef = jax.tree.flatten(like)
        best: HostSnapshot | None = None
        for path in sorted(self.directory.glob("*.npz")):
            if ".tmp" in path.name:
                continue  # a write that a kill interrupted
            try:
                with np.load(path, allow_pickle=False) as data:
                    meta = json.loads(bytes(data["meta"]).decode())
                    if best is not None and meta["step"] <= best.step:
                        continue
                    leaves = [data[f"leaf{i}"] for i in range(meta["leaves"])]
            except (OSError, ValueError, KeyError) as exc:
                log.warning("replica file %s is unreadable, skipped: %s", path, exc)
                continue
            shapes_ok = len(leaves) == len(leaves_like) and all(
                a.shape == np.shape(b) and a.dtype == np.asarray(b).dtype
                for a, b in zip(leaves, leaves_like, strict=True)
            )
            if not shapes_ok:
                log.warning("replica file %s does not match the state's structure, skipped", path)
                continue
            best = replica(meta["step"], meta["data_position"], jax.tree.unflatten(treedef, leaves))
        if best is None:
            raise SnapshotUnavailable(f"no usable replica file in {self.directory}")
        return best

    def close(self) -> None:
        self._pool.shutdown(wait=True)
