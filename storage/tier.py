"""The interface every durable checkpoint tier implements, and what they share.

A tier stores committed checkpoints of host snapshots and gives them back verified. Every call takes an
explicit timeout: the caller owns the deadline. A tier is a restore source (``elastic_runtime.core.restore``): a
checkpoint that fails verification is reported to ``corruption_listeners`` and the next one is tried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from elastic_runtime.core.errors import CheckpointInvalid
from elastic_runtime.core.fingerprint import STATE_DIGEST, host_digest
from elastic_runtime.core.restore import CorruptionListener, restore_newest
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.manifest import KeyPart, LeafEntry, Manifest, key_of

PyTree = Any


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as a listing shows it."""

    tier: str
    step: int
    location: str  # a local directory or a gs:// prefix
    nbytes: int
    data_position: int
    created: float  # wall time the manifest was written
    files: int


class CheckpointTier(Protocol):
    """A place checkpoints are committed to and restored from (disk, GCS, a RAM directory)."""

    name: str
    corruption_listeners: list[CorruptionListener]

    def save(self, snapshot: HostSnapshot, *, timeout: float) -> CheckpointInfo:
        """Write ``snapshot`` and commit it (manifest last). Raises StorageError; a partial write stays invisible."""
        ...

    def restore(self, step: int, like: PyTree = None, *, timeout: float) -> HostSnapshot:
        """Read and verify ``step``. Raises CheckpointInvalid, SnapshotUnavailable or StorageError."""
        ...

    def latest(self, like: PyTree = None, timeout: float | None = 30.0) -> HostSnapshot:
        """The newest checkpoint that verifies; older ones are tried when newer ones are corrupt.

        Raises SnapshotUnavailable when none does.
        """
        ...

    def steps(self, *, timeout: float) -> list[int]:
        """The steps of :meth:`list` (a restore source: ``elastic_runtime.core.restore``). Raises StorageError."""
        ...

    def list(self, *, timeout: float) -> list[CheckpointInfo]:
        """Committed checkpoints (those with a manifest), newest first. Raises StorageError."""
        ...

    def verify(self, step: int, *, timeout: float) -> CheckpointInfo:
        """Check every file of ``step`` against its manifest. Raises CheckpointInvalid naming the bad file."""
        ...

    def delete(self, step: int, *, timeout: float) -> None:
        """Remove ``step`` (its manifest first, so it is never half-visible). Raises StorageError."""
        ...


def latest_verified(tier: CheckpointTier, like: PyTree, timeout: float | None) -> HostSnapshot:
    """Shared ``latest``: the newest checkpoint of ``tier`` that verifies (``elastic_runtime.core.restore``)."""
    return restore_newest([tier], like, timeout=300.0 if timeout is None else timeout)[1]


def rebuild_tree(manifest: Manifest, arrays: dict[tuple[KeyPart, ...], np.ndarray], like: PyTree) -> PyTree:
    """Put restored arrays back into the state's structure.

    With ``like`` (the state as the job builds it) the result has exactly its structure; every leaf must match
    the manifest's key, shape and dtype. Without it, nested dicts and lists are rebuilt from the key paths.

    Raises:
        SnapshotUnavailable: the checkpoint holds a different structure than ``like`` (another model).
    """
    from elastic_runtime.core.errors import SnapshotUnavailable

    if like is None:
        return _nested(manifest.leaves, arrays)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(like)
    by_key = {leaf.key: leaf for leaf in manifest.leaves}
    out = []
    for path, leaf in with_path:
        key = key_of(path)
        entry = by_key.get(key)
        if entry is None:
            raise SnapshotUnavailable(f"checkpoint of step {manifest.step} has no array at {key}")
        # A template leaf without a dtype (a Python scalar) is checked by shape only.
        dtype = getattr(leaf, "dtype", None)
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        if shape != entry.shape or (dtype is not None and np.dtype(dtype).name != entry.dtype):
            held = "?" if dtype is None else np.dtype(dtype).name
            raise SnapshotUnavailable(
                f"checkpoint of step {manifest.step} holds {entry.dtype}{list(entry.shape)} at {key}, "
                f"the state has {held}{list(shape)}"
            )
        out.append(arrays[key])
    if len(with_path) != len(manifest.leaves):
        raise SnapshotUnavailable(
            f"checkpoint of step {manifest.step} holds {len(manifest.leaves)} arrays, the state {len(with_path)}"
        )
    return jax.tree_util.tree_unflatten(treedef, out)


def _nested(leaves: tuple[LeafEntry, ...], arrays: dict[tuple[KeyPart, ...], np.ndarray]) -> PyTree:
    root: dict[KeyPart, Any] = {}
    for leaf in leaves:
        if not leaf.key:
            return arrays[leaf.key]
        node = root
        for part in leaf.key[:-1]:
            node = node.setdefault(part, {})
        node[leaf.key[-1]] = arrays[leaf.key]

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: lists(v) for k, v in node.items()}
        if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
            return [items[i] for i in range(len(items))]
        return items

    return lists(root)


def snapshot_from(manifest: Manifest, tree: PyTree, seconds: float, *, where: str) -> HostSnapshot:
    """The snapshot a checkpoint read back holds, checked against the digest of the state it was verified with
    where it records one. Raises CheckpointInvalid: the state read is not that state."""
    recorded = manifest.metadata.get(STATE_DIGEST)
    if recorded is not None:
        # In the saved state's leaf order: a tree rebuilt without ``like`` may flatten in another.
        arrays = {key_of(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
        ordered = [arrays.get(leaf.key) for leaf in manifest.leaves]
        whole = all(leaf is not None for leaf in ordered)
        found = f"{host_digest(ordered if whole else jax.tree.leaves(tree)):08x}"
        if found != recorded:
            reason = (
                f"the state read has digest {found}, not {recorded}, the digest of the state verified on the "
                "devices: it changed between the check and the write, though every file matches its CRC32C"
            )
            raise CheckpointInvalid(f"{where}: {reason}", path=where, reason=reason)
    return HostSnapshot(
        step=manifest.step,
        data_position=manifest.data_position,
        tree=tree,
        nbytes=sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree)),
        seconds=seconds,
        metadata=dict(manifest.metadata),
    )
