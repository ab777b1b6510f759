"""The RAM tier: the newest complete snapshot of the training state in host memory.

On devices whose memory is the host's (CPU devices, ``in_host_memory``) the executor commits the step's new
state itself: it is in host memory already, and no step overwrites its input. Elsewhere it is copied.

The copy is made by XLA, not by Python: the state is placed in the devices' ``pinned_host`` memory, sharded
so that each device writes a distinct piece and replicated data is copied once. The executor fuses that
copy into the compiled step when it snapshots every step (on an accelerator a DMA overlapped with the step);
otherwise a small compiled copy is queued on the
devices right behind the due step (``dispatch_copy``, awaited with the step), or run on its own
(``copy_to_host``, synchronous; ``capture``, which runs it in a background thread and commits when it
completes). Copying in Python instead, shard by shard into numpy, was slower and competed with XLA for the
cores (docs/benchmarks.md has the figures).

A snapshot is committed only once its arrays are complete, so the committed one is always whole: a failed
copy leaves the previous one in place. Host arrays are turned into numpy only when someone reads the
snapshot (a restore, a slower tier writing it out): most snapshots are replaced unread. Snapshots are never
overwritten: one handed to a reader stays valid for as long as the reader holds it.

The copy fused into the step writes into the buffers of a snapshot that was replaced unread (``spare``):
taking fresh host memory every step, while the committed snapshot is still held, costs a measurable share
of a small step. A snapshot becomes spare only once nothing references it and it was never read, so no
reader can see its buffers change.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable

log = logging.getLogger(__name__)

PyTree = Any
HOST_MEMORY = "pinned_host"


class HostSnapshot:
    """The state after ``step`` in host memory, with the data position needed to resume exactly.

    ``tree`` holds numpy arrays with the state's structure. A snapshot made from host-memory jax arrays
    assembles them into numpy on first access (once, thread-safe); ``assemble`` replaces that conversion
    (the multi-process worker's: this process's boxes of device arrays, ``elastic_runtime.storage.boxes.local_copy``).
    """

    def __init__(
        self,
        *,
        step: int,
        data_position: int,
        tree: PyTree,
        nbytes: int,
        seconds: float,
        metadata: dict[str, Any],
        on_unread: Callable[[PyTree], None] | None = None,
        assemble: Callable[[PyTree], PyTree] | None = None,
    ) -> None:
        self.step = step
        self.data_position = data_position
        self.nbytes = nbytes
        self.seconds = seconds  # how long the copy took beyond the step (0 when compiled into the step)
        self.metadata = metadata
        self._tree = tree
        self._lock = threading.Lock()
        self._assemble = assemble or _to_numpy
        # Holds the host arrays until the snapshot is read; ``on_unread`` gets them if it never is.
        self._unread = [tree]
        if on_unread is not None:
            weakref.finalize(self, _hand_back, self._unread, on_unread)

    @property
    def tree(self) -> PyTree:
        with self._lock:
            if self._unread:  # the first read: numpy views may share the host buffers from now on
                self._tree = self._assemble(self._unread.pop())
            return self._tree

    def unread(self) -> PyTree | None:
        """The tree as it was given, while no one has read the snapshot (its host copy not made yet), else None:
        a writer may then make a copy of its own, into buffers it keeps, without making the snapshot's."""
        with self._lock:
            return self._unread[0] if self._unread else None

    def __repr__(self) -> str:
        return f"HostSnapshot(step={self.step}, data_position={self.data_position}, nbytes={self.nbytes})"


def in_host_memory(mesh: Mesh) -> bool:
    """Whether the state on ``mesh`` lives in host memory already (CPU devices): a snapshot there is the state
    itself, held by reference, as safe as a copy in the same memory (no step overwrites its input: nothing is
    donated) and free, where a copy on every step cost 4% of the demo model's step."""
    return all(device.platform == "cpu" for device in mesh.devices.flat)


def host_sharding(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """Where a leaf's host copy lives: ``sharding`` in host memory, its replicas split up where they divide.

    Each mesh axis the leaf is replicated over is given to the first dimension it divides, so every device
    copies a distinct piece and the copy moves the state's bytes once, not once per replica. An axis that
    divides nothing stays replicated (correct, only more bytes).
    """
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    used = {axis for entry in spec if entry is not None for axis in ((entry,) if isinstance(entry, str) else entry)}
    for axis, size in mesh.shape.items():
        if axis in used or size == 1:
            continue
        for dim, entry in enumerate(spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            split = size * int(np.prod([mesh.shape[a] for a in axes]))
            if shape[dim] % split == 0:
                spec[dim] = (*axes, axis) if axes else axis
                break
    return NamedSharding(mesh, PartitionSpec(*spec), memory_kind=HOST_MEMORY)


def host_shardings(shardings: PyTree, shapes: PyTree) -> PyTree:
    """``host_sharding`` for every leaf of ``shapes`` (anything with ``.shape``). ``shardings`` may be a prefix
    of it, as the job's ``state_specs`` may be (one spec for a whole subtree): each leaf under a prefix gets
    its own host layout, which depends on its shape."""
    return jax.tree.map(
        lambda s, subtree: jax.tree.map(lambda x: host_sharding(s, tuple(np.shape(x))), subtree), shardings, shapes
    )


class RamTier:
    """Keeps the newest complete host copy of the state. Which steps are copied is the caller's choice
    (the executor's: ``elastic_runtime.core.cadence``).

    ``listeners`` are called with each committed snapshot, in the thread that completed it (keep them short:
    hand the snapshot to your own thread or queue); ``failure_listeners`` with the step and error of a failed
    copy.
    """

    name = "ram"

    def __init__(self) -> None:
        self.listeners: list[Callable[[HostSnapshot], None]] = []
        self.failure_listeners: list[Callable[[int, BaseException], None]] = []
        self.corruption_listeners: list[Callable[[str, int, CheckpointInvalid], None]] = []  # host memory: never
        self._lock = threading.Lock()
        self._committed: HostSnapshot | None = None
        # The newest snapshot whose replicas agreed (runtime/core/fingerprint.py): where a divergence goes back to.
        self._verified: HostSnapshot | None = None
        self._copies: dict[Any, Any] = {}  # (tree structure, host shardings) -> the compiled copy
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ram-snapshot")
        self._in_flight: Future[None] | None = None
        # Host arrays of snapshots replaced unread. Two: a batch of pipelined steps ends with a commit and no
        # dispatch, and the next begins with a dispatch before any commit.
        self._spares: deque[PyTree] = deque(maxlen=2)

    def dispatch_copy(self, state: PyTree, *, step: int) -> PyTree | None:
        """Queue the copy of ``state`` into host memory on the devices and return its host arrays at once (not
        yet complete: wait for them before ``commit``); None if it could not be queued (reported)."""
        try:
            return self._compiled_copy(state)(state)
        except Exception as exc:
            self.report_failure(step, exc)
            return None

    def prepare(self, like: PyTree) -> bool:
        """Compile the copy for the layout of ``like`` (arrays, or ShapeDtypeStructs with shardings) now, so
        that the first snapshot on a new mesh does not wait for it. True when it was compiled now."""
        known = len(self._copies)
        self._compiled_copy(like)
        return len(self._copies) > known

    def copy_to_host(self, state: PyTree, *, step: int) -> tuple[PyTree, float] | None:
        """``state`` copied into host memory (complete on return) and the seconds the copy took, not counting
        its compile on a new layout; None if the copy failed (reported)."""
        try:
            copy = self._compiled_copy(state)
            started = time.perf_counter()
            host = jax.block_until_ready(copy(state))
            return host, time.perf_counter() - started
        except Exception as exc:
            self.report_failure(step, exc)
            return None

    def capture(
        self, state: PyTree, *, step: int, data_position: int, metadata: dict[str, Any], notify: bool = True
    ) -> None:
        """Copy ``state`` (device arrays) to host memory in the background; it is committed once complete
        (``notify``: see :meth:`commit`).

        Returns at once (the training loop goes on meanwhile; jax arrays are immutable, so the state cannot
        change under the copy); waits first for a copy still in flight, so at most one runs. Never raises: a
        copy that fails (its arrays were lost with a device) is reported to ``failure_listeners`` and the
        previous snapshot stays the committed one.
        """
        self.wait()
        started = time.perf_counter()

        def copy() -> None:
            # In this thread: on CPU devices XLA runs the copy in the thread that calls it.
            copied = self.copy_to_host(state, step=step)
            if copied is not None:
                seconds = time.perf_counter() - started
                self.commit(
                    copied[0], step=step, data_position=data_position, metadata=metadata, seconds=seconds, notify=notify
                )

        self._in_flight = self._pool.submit(copy)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the copy ``capture`` started, if any."""
        if self._in_flight is not None:
            self._in_flight.result(timeout)
            self._in_flight = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _compiled_copy(self, state: PyTree) -> Any:
        leaves, treedef = jax.tree.flatten(state)
        target = tuple(host_sharding(leaf.sharding, leaf.shape) for leaf in leaves)
        copy = self._copies.get((treedef, target))
        if copy is None:
            out = jax.tree.unflatten(treedef, target)
            copy = self._copies[(treedef, target)] = (
                jax.jit(lambda tree: tree, out_shardings=out).lower(state).compile()
            )
        return copy

    def commit(
        self,
        host: PyTree,
        *,
        step: int,
        data_position: int,
        metadata: dict[str, Any],
        seconds: float = 0.0,
        reuse: bool = False,
        notify: bool = True,
        verified: bool = True,
    ) -> None:
        """Make ``host`` (complete host-memory arrays of the state after ``step``) the committed snapshot.

        With ``reuse`` its buffers become the spare (``take_spare``) once it is replaced and dropped unread.
        ``notify``: tell the ``listeners`` (the durable tiers); not for the initial state, a restore point that no
        durable tier needs (``init`` makes it again), nor a state whose replicas were not compared. ``verified``:
        its replicas agreed (or none was compared: no fingerprints); :meth:`fall_back_to_verified` returns to it.
        """
        nbytes = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(host))
        snapshot = HostSnapshot(
            step=step,
            data_position=data_position,
            tree=host,
            nbytes=nbytes,
            seconds=seconds,
            metadata=dict(metadata),
            on_unread=self._spares.append if reuse else None,
        )
        with self._lock:
            if self._committed is not None and self._committed.step > step:
                return  # a background copy (the initial state's) that ended after a newer step's commit
            replaced, self._committed = self._committed, snapshot
            if verified:
                self._verified = snapshot
        if replaced is not None and not reuse:  # freeing its buffers takes a while: not in the training thread
            self._pool.submit(_release, replaced)
        del replaced  # with reuse: its buffers are the spare now, unless a reader still holds it
        for listener in self.listeners if notify else ():
            listener(snapshot)

    def fall_back_to_verified(self) -> None:
        """The state's replicas diverged: the snapshots after the newest verified one may hold the corruption.
        The verified one is the RAM tier's snapshot again (and a restore takes it)."""
        with self._lock:
            self._committed = self._verified

    def take_spare(self, shardings: PyTree) -> PyTree | None:
        """Host arrays no snapshot uses any more, laid out as ``shardings`` (a spare of another layout, from
        before a re-mesh, is dropped), for the next copy to write into; None if there is none."""
        try:
            spare = self._spares.pop()
        except IndexError:
            return None
        leaves, expected = jax.tree.leaves(spare), jax.tree.leaves(shardings)
        if len(leaves) != len(expected) or any(a.sharding != b for a, b in zip(leaves, expected, strict=True)):
            return None
        return spare

    def report_failure(self, step: int, exc: BaseException) -> None:
        """Tell ``failure_listeners`` that the copy of ``step`` failed (the committed snapshot stays)."""
        log.error("RAM snapshot of step %d failed: %s: %s", step, type(exc).__name__, exc)
        for listener in self.failure_listeners:
            listener(step, exc)

    def latest(self, like: PyTree = None, timeout: float | None = 30.0) -> HostSnapshot:
        """The newest complete snapshot, after the copy ``capture`` started (if any) has finished.

        ``like`` is accepted for the restore-source protocol; RAM needs no template.

        Raises:
            SnapshotUnavailable: no snapshot has completed yet.
        """
        self.wait(timeout)
        with self._lock:
            snapshot = self._committed
        if snapshot is None:
            raise SnapshotUnavailable("the RAM tier holds no snapshot yet")
        return snapshot

    def latest_verified(self, like: PyTree = None, timeout: float | None = 30.0) -> HostSnapshot:
        """The newest snapshot whose replicas agreed (the newest of all when the state is not fingerprinted):
        what a durable tier may hold.

        Raises:
            SnapshotUnavailable: none has completed yet.
        """
        self.wait(timeout)
        with self._lock:
            snapshot = self._verified
        if snapshot is None:
            raise SnapshotUnavailable("the RAM tier holds no verified snapshot yet")
        return snapshot

    def steps(self, *, timeout: float) -> list[int]:
        """The step of the snapshot it holds, if any (a restore source: ``elastic_runtime.core.restore``)."""
        try:
            return [self.latest(timeout=timeout).step]
        except SnapshotUnavailable:
            return []

    def restore(self, step: int, like: PyTree = None, *, timeout: float) -> HostSnapshot:
        """The snapshot of ``step``. Raises SnapshotUnavailable when RAM holds another step (or none)."""
        snapshot = self.latest(like, timeout)
        if snapshot.step != step:
            raise SnapshotUnavailable(f"the RAM tier holds step {snapshot.step}, not {step}")
        return snapshot


def _to_numpy(tree: PyTree) -> PyTree:
    return jax.tree.map(np.asarray, tree)


def _hand_back(unread: list[PyTree], on_unread: Callable[[PyTree], None]) -> None:
    """A snapshot's finalizer: its host arrays go to ``on_unread`` if it was never read."""
    if unread:
        on_unread(unread.pop())


def _release(snapshot: HostSnapshot) -> None:
    """Drops the last reference to a replaced snapshot (unless a reader still holds it), in the pool thread."""
    del snapshot
