"""Replica files for multi-process runs: each worker's host copy of its shards, on its host.

Each worker keeps its own shards of every committed step in host memory (:func:`replica`, of
:func:`elastic_runtime.storage.boxes.local_copy`); a re-formed group restores from them
(:class:`elastic_runtime.storage.boxes.SliceRestore`).

:class:`ReplicaFiles` keeps the same copy in files, one folder per process, under ``/dev/shm`` by default
(survives the loss of every worker process, not of the host) or any directory, in the disk tier's format
with its packed layout (:mod:`elastic_runtime.storage.packed`: every array in one file) and a manifest that lists
the file's size and CRC32C, committed last, so a kill mid-write leaves the previous replica whole and a damaged one is
detected on read. No pickle.

Every replica carries its run's identity in its manifest's metadata (:func:`run_identity`: the run id and
a fingerprint of the job: state structure, shapes, dtypes, target steps); :meth:`ReplicaFiles.readable`
restores only replicas of this run and names the ones it skipped, so a folder that holds another run's
files never resumes the wrong run.

Every replica also names the generation of the group that wrote it (``"generation"`` in its metadata,
:func:`replica`). The controller fences each generation it replaces at the step the group went on from;
:meth:`ReplicaFiles.readable`, given those fences, never restores a replica that a generation wrote past its
fence (a worker cut off from the controller whose write came late): that step is not in the run's history.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable, StorageError
from elastic_runtime.core.folders import PROGRAMS_PREFIX
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.boxes import box_copy, local_copy
from elastic_runtime.storage.disk import DiskTier

log = logging.getLogger(__name__)

_TIMEOUT_S = 120.0  # one replica write or read; /dev/shm is memory
MAX_PINS = 4  # replicas kept for durable steps not yet known to be committed (see ReplicaFiles.pin)

PyTree = Any


def job_fingerprint(like: PyTree, target_steps: int) -> str:
    """A hash of what makes two runs' states interchangeable: the tree structure, every leaf's shape and
    dtype, and the target step count."""
    leaves, structure = jax.tree.flatten(like)
    parts = [str(structure), str(target_steps)]
    parts += [f"{np.shape(leaf)}:{getattr(leaf, 'dtype', None) or np.asarray(leaf).dtype}" for leaf in leaves]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def run_identity(run_id: str, like: PyTree, target_steps: int) -> dict[str, str]:
    """The metadata every replica of this run carries (and a restore requires)."""
    return {"run_id": run_id, "job": job_fingerprint(like, target_steps)}


def replica(
    step: int,
    data_position: int,
    tree: PyTree,
    identity: dict[str, str] | None = None,
    *,
    generation: int | None = None,
) -> HostSnapshot:
    """A worker's replica: the state after ``step`` as host arrays, with the data position to resume exactly,
    and as its metadata the run's identity (:func:`run_identity`) and the ``generation`` of the group that
    computed it."""
    nbytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(tree))
    metadata = _metadata(identity, generation)
    return HostSnapshot(
        step=step, data_position=data_position, tree=tree, nbytes=nbytes, seconds=0.0, metadata=metadata
    )


def _metadata(identity: dict[str, str] | None, generation: int | None) -> dict[str, str]:
    return dict(identity or {}) | ({} if generation is None else {"generation": str(generation)})


def device_replica(
    step: int,
    data_position: int,
    state: PyTree,
    like: PyTree,
    identity: dict[str, str] | None = None,
    *,
    generation: int | None = None,
    on_unread: Callable[[PyTree], None] | None = None,
) -> HostSnapshot:
    """A replica of ``state`` (jax arrays on the group's devices) whose host copy of this process's boxes
    (:func:`elastic_runtime.storage.boxes.local_copy`; ``like``: their shapes and dtypes) is made on its first read
    (a restore, a durable write, a worker leaving its group), or never for a replica replaced unread; the replica
    file's writer copies the boxes into buffers of its own (:meth:`ReplicaFiles._staged`), off the step's critical
    path. The compiled step does not donate its input, so ``state`` stays valid while held; once the replica is
    dropped unread, ``on_unread`` gets ``state`` (a later step may write into it:
    ``elastic_runtime.cluster.worker.spares``). It lives on the group's backend, so whoever leaves the group reads
    the replica first (``elastic_runtime.cluster.worker.forming``)."""
    nbytes = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(like))
    return HostSnapshot(
        step=step,
        data_position=data_position,
        tree=state,
        nbytes=nbytes,
        seconds=0.0,
        metadata=_metadata(identity, generation),
        assemble=local_copy,
        on_unread=on_unread,
    )


class ReplicaFiles:
    """This process's newest replica on its host, in the disk tier's format (a manifest with the CRC32C of
    every file, committed last), written in the background; ``readable`` reads any process's, verified.

    Args:
        directory: where the replicas of every process live (``/dev/shm/...`` to survive process restarts
            on this host); each process has a folder of its own in it.
        name: this process's folder (stable across its restarts, e.g. ``worker-0``).
        keep: replicas kept per process (the newest ones; two, so a crash mid-write leaves one whole).
    """

    def __init__(self, directory: str | os.PathLike[str], name: str, *, keep: int = 2) -> None:
        self.directory = Path(directory)
        # No fsync on /dev/shm: a tmpfs lives no longer than the host, and a process killed mid-write loses
        # nothing the kernel holds (the manifest, renamed last, still commits). The fsyncs were about half of
        # each replica's write, every step, on the cores the step runs on.
        in_memory = self.directory.resolve().is_relative_to(Path("/dev/shm").resolve())
        # Packed (one file per replica, storage/packed.py): only this library reads replica files, and Orbax's
        # layout cost a file and a folder per array, which at the demo's size tripled each step's write.
        self.tier = DiskTier(self.directory / name, name="shm", check_space=False, packed=True, sync=not in_memory)
        self.keep = keep
        for torn in self.tier.sweep():  # an earlier process of this name was killed mid-write
            log.info("removed a torn replica: %s", torn)
        # The steps this folder holds. This process is its one writer, so the list is kept here rather than read
        # back (every manifest parsed) after each write.
        self._held = set(self.tier.steps(timeout=_TIMEOUT_S))
        self._staging: list[np.ndarray | None] = []  # the writer's host copy of each leaf (``_staged``)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replica-file")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self.submitted = -1  # the step of the last :meth:`save` (older after a rollback)
        self.skipped: list[str] = []  # what the last :meth:`readable` would not restore, "PATH: why"
        self.unreadable: set[Path] = set()  # replicas that failed verification: never listed again
        self.pinned: list[int] = []  # steps kept beside the newest ones (:meth:`pin`)

    @property
    def on_write(self) -> list[Callable[[int], None]]:
        """Called with the step mid-write (its files written, not yet committed), in the writer thread."""
        return self.tier.before_commit

    def save(self, snapshot: HostSnapshot) -> None:
        """Start writing ``snapshot``, after the previous write finished (so no committed step is skipped)."""
        self.wait()
        with self._lock:
            self._pending = self._pool.submit(self._write, snapshot)
            self.submitted = snapshot.step

    def pin(self, step: int) -> None:
        """Keep the replica of ``step`` (once written) beside the ``keep`` newest, until :meth:`committed`
        names a newer committed durable step: ``step`` was due for a durable checkpoint, and a rollback to
        that checkpoint then reads this process's shards from here and only a lost process's from the
        durable tier. Durable writes lag (a due step is skipped while the previous write runs), so the newest
        committed step may be older than the newest due one. At most ``MAX_PINS`` stay pinned."""
        with self._lock:
            self.pinned = [*self.pinned, step][-MAX_PINS:]

    def committed(self, step: int) -> None:
        """Durable step ``step`` is committed: replicas pinned for older steps are no longer needed."""
        with self._lock:
            self.pinned = [s for s in self.pinned if s >= step]

    def _write(self, snapshot: HostSnapshot) -> None:
        started = time.monotonic()
        self.tier.save(self._staged(snapshot), timeout=_TIMEOUT_S)
        self._held.add(snapshot.step)
        with self._lock:
            pinned = set(self.pinned)
        for step in sorted(self._held, reverse=True)[self.keep :]:
            if step not in pinned:
                self.tier.delete(step, timeout=_TIMEOUT_S)
                self._held.discard(step)
        log.debug("replica of step %d written in %.3f s", snapshot.step, time.monotonic() - started)

    def _staged(self, snapshot: HostSnapshot) -> HostSnapshot:
        """``snapshot`` with its host copy made into this writer's own buffers, used again for every step's file,
        when no one has made one yet (a replica on the devices, :func:`device_replica`). At 64 MB a process, the
        kernel zeroing a fresh copy's pages took a fifth of a worker's CPU, more than the copy itself."""
        tree = snapshot.unread()
        if tree is None or not any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree)):
            return snapshot
        leaves, structure = jax.tree.flatten(tree)
        if len(self._staging) != len(leaves):
            self._staging = [None] * len(leaves)
        self._staging = [box_copy(leaf, out) for leaf, out in zip(leaves, self._staging, strict=True)]
        staged = jax.tree.unflatten(structure, self._staging)
        return HostSnapshot(
            step=snapshot.step,
            data_position=snapshot.data_position,
            tree=staged,
            nbytes=snapshot.nbytes,
            seconds=snapshot.seconds,
            metadata=snapshot.metadata,
        )

    def wait(self) -> None:
        with self._lock:
            pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except StorageError as exc:  # a failed write leaves the previous replica; training goes on
                log.error("replica write failed: %s", exc)

    def listed(
        self,
        identity: dict[str, str] | None = None,
        *,
        max_step: int | None = None,
        fences: dict[int, int] | None = None,
        limit: int | None = None,
    ) -> dict[int, list[DiskTier]]:
        """The ``limit`` newest steps some replica here holds whose manifest says it is ours (``identity``,
        ``max_step``, ``fences``, as :meth:`readable`), newest first, each with the folders holding it; only the
        manifests are read (:meth:`read` reads and verifies the data). A replica that failed :meth:`read`
        before is left out. What was skipped, and why, is then in :attr:`skipped`."""
        # Beside the processes' replica folders: the workers' compiled programs (runtime/core/programs.py).
        folders = (
            sorted(p for p in self.directory.iterdir() if p.is_dir() and not p.name.startswith(PROGRAMS_PREFIX))
            if self.directory.is_dir()
            else []
        )
        identity = dict(identity or {})
        layout = identity.pop("layout", None)
        candidates: dict[int, list[DiskTier]] = {}
        skipped: list[str] = []
        self.skipped = skipped
        for folder in folders:
            tier = DiskTier(folder, name="shm", check_space=False)
            try:
                steps = tier.steps(timeout=_TIMEOUT_S)
            except StorageError as exc:
                skipped.append(f"{folder}: cannot list: {exc}")
                continue
            for step in steps:
                if tier.path_of(step) in self.unreadable or not _holds(tier, step, layout):
                    continue  # known damaged (said when found), or another position's shards: not worth a word
                why = _not_ours(tier, step, identity, max_step, fences or {})
                if why:
                    skipped.append(f"{tier.path_of(step)}: {why}")
                else:
                    candidates.setdefault(step, []).append(tier)
        newest = sorted(candidates, reverse=True)[:limit]
        return {step: candidates[step] for step in newest}

    def read(self, step: int, tiers: list[DiskTier], like: PyTree) -> HostSnapshot:
        """Replica ``step`` from the first of ``tiers`` (from :meth:`listed`) that verifies. One that does not is
        added to :attr:`skipped` and never listed again.

        Raises:
            CheckpointInvalid: none verifies; ``path`` and ``reason`` are the last one's.
        """
        failure: CheckpointInvalid | None = None
        for tier in tiers:
            try:
                return tier.restore(step, like, timeout=_TIMEOUT_S)
            except (CheckpointInvalid, SnapshotUnavailable, StorageError) as exc:
                path = tier.path_of(step)
                self.unreadable.add(path)
                self.skipped.append(f"{path}: {exc}")
                failure = CheckpointInvalid(
                    f"replica of step {step} unreadable: {exc}",
                    path=getattr(exc, "path", str(path)),
                    reason=getattr(exc, "reason", str(exc)),
                )
        assert failure is not None, "read needs a folder to read from"
        raise failure

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _holds(tier: DiskTier, step: int, layout: str | None) -> bool:
    """Whether replica ``step`` holds the shards of ``layout`` (any, when None; an unreadable manifest is
    judged, and reported, by :func:`_not_ours`)."""
    if layout is None:
        return True
    try:
        return tier.manifest(step).metadata.get("layout", layout) == layout
    except (CheckpointInvalid, SnapshotUnavailable):
        return True


def _not_ours(
    tier: DiskTier, step: int, identity: dict[str, str] | None, max_step: int | None, fences: dict[int, int]
) -> str:
    """Why replica ``step`` of ``tier`` must not be restored in this run; "" when it may."""
    if max_step is not None and step > max_step:
        return f"step {step} is past the target step {max_step}"
    if not identity and not fences:
        return ""
    try:
        metadata = tier.manifest(step).metadata
    except (CheckpointInvalid, SnapshotUnavailable) as exc:
        return f"unreadable manifest: {exc}"
    for key, want in (identity or {}).items():
        got = metadata.get(key)
        if got != want:
            what = "another run's replica" if key == "run_id" else "another job's replica (structure, shapes or target)"
            return f"{what}: {key} {got!r}, this run's {want!r}"
    generation = metadata.get("generation")
    if generation is None:
        return ""  # written before replicas named their generation; nothing to judge it by
    try:
        fence = fences.get(int(generation))
    except ValueError:
        return f"unreadable generation {generation!r} in its manifest"
    if fence is not None and step > fence:
        return f"written by generation {generation} after it was fenced at step {fence}"
    return ""
