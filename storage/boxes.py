"""A process's own shards of a state sharded over slices of processes: the box of each array it holds.

The multi-process mesh has one replica axis across slices (``data`` by default; each slice a fixed group of
processes holding one full copy of the state) and its other axes (``model`` by default, or a model's own:
``fsdp``, ``tensor``, ...) span the devices of every process of a slice, so a state sharded over them is
sharded across the processes of a slice (:class:`~elastic_runtime.core.mesh.ProcessMesh`). With one process per slice
(the default) every process holds the whole state.

Each process copies to host memory only what it holds: for every array the smallest box of global indices
that covers its shards (:func:`local_box`, :func:`local_copy`). Processes at the same position of different
slices hold the same boxes, so a slice is its neighbours' replica, shard for shard. What moves shards between
processes (a restore, the neighbour replica) is in :mod:`elastic_runtime.cluster.collectives`.
"""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import numpy as np

from elastic_runtime.core.errors import SnapshotUnavailable

__all__ = [
    "Box",
    "box_copy",
    "leaf_dtype",
    "local_box",
    "local_copy",
    "local_like",
    "over_slice",
    "per_leaf",
    "slice_axes",
    "uses_axis",
    "within",
]

PyTree = Any
Box = tuple[slice, ...]


def per_leaf(shardings: PyTree, tree: PyTree) -> PyTree:
    """``shardings`` (a pytree prefix of ``tree``, as a job's specs are) with one sharding per leaf of ``tree``."""
    return jax.tree.map(lambda sharding, subtree: jax.tree.map(lambda _: sharding, subtree), shardings, tree)


def uses_axis(shardings: PyTree, tree: PyTree, axis: str) -> list[str]:
    """The leaves of ``tree`` (as tree paths) that ``shardings`` splits over mesh axis ``axis``."""
    found: list[str] = []
    for path, sharding in jax.tree_util.tree_flatten_with_path(per_leaf(shardings, tree))[0]:
        for entry in sharding.spec:
            names = entry if isinstance(entry, tuple) else (entry,)
            if axis in names:
                found.append(jax.tree_util.keystr(path) or "the state")
                break
    return found


def leaf_dtype(leaf: Any) -> np.dtype[Any]:
    """A leaf's dtype: an array's, a ShapeDtypeStruct's, or a Python number's as NumPy takes it."""
    return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _key(index: Box) -> tuple[tuple[int | None, int | None], ...]:
    return tuple((s.start, s.stop) for s in index)  # slices are not hashable before Python 3.12


def local_box(shape: tuple[int, ...], sharding: jax.sharding.Sharding, process: int | None = None) -> Box:
    """The box of global indices this process (or ``process``) holds of an array of ``shape`` under ``sharding``.

    Raises:
        SnapshotUnavailable: the process's shards do not fill a box (a device order that interleaves processes).
    """
    process = jax.process_index() if process is None else process
    indices: dict[Any, Box] = {
        _key(index): index
        for device, index in sharding.devices_indices_map(shape).items()
        if index is not None and cast(Any, device).process_index == process
    }
    box = tuple(
        slice(
            min(index[d].start or 0 for index in indices.values()),
            max(size if index[d].stop is None else index[d].stop for index in indices.values()),
        )
        for d, size in enumerate(shape)
    )
    volume = math.prod(b.stop - b.start for b in box)
    held = sum(_volume(index, shape) for index in indices.values())
    if held != volume:  # a NamedSharding's distinct shards are disjoint: they fill the box exactly or not at all
        raise SnapshotUnavailable(
            f"process {process}'s shards of an array of shape {shape} do not fill a box; "
            "order the mesh's devices by process"
        )
    return box


def _volume(index: Box, shape: tuple[int, ...]) -> int:
    return math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def within(index: Box, box: Box, shape: tuple[int, ...]) -> Box:
    """``index`` (global) relative to ``box``."""
    return tuple(
        slice(start - b.start, stop - b.start)
        for (start, stop, _), b in zip((s.indices(n) for s, n in zip(index, shape, strict=True)), box, strict=True)
    )


def local_copy(tree: PyTree) -> PyTree:
    """This process's box of every array of ``tree`` (:func:`local_box`), as numpy arrays in host memory."""
    return jax.tree.map(box_copy, tree)


def box_copy(leaf: Any, out: np.ndarray | None = None) -> np.ndarray:
    """This process's box of ``leaf`` in host memory: written into ``out`` when it has the box's shape and dtype
    (a buffer used again: fresh host memory is zeroed by the kernel page by page, which cost a replica writer
    more than the copy), else into a new array."""
    if not isinstance(leaf, jax.Array):
        return np.array(leaf)
    box = local_box(leaf.shape, leaf.sharding)
    shape = tuple(b.stop - b.start for b in box)
    if out is None or out.shape != shape or out.dtype != leaf.dtype:
        out = np.empty(shape, leaf.dtype)
    copied: set[Any] = set()
    for shard in leaf.addressable_shards:
        if _key(shard.index) not in copied:  # replicated over this process's devices: copy once
            copied.add(_key(shard.index))
            out[within(shard.index, box, leaf.shape)] = np.asarray(shard.data)
    return out


def local_like(template: PyTree, shardings: PyTree) -> PyTree:
    """Shapes and dtypes of this process's boxes of ``template`` under ``shardings`` (what :func:`local_copy`
    returns on that layout): what a replica file of this process must hold."""

    def one(leaf: Any, sharding: Any) -> jax.ShapeDtypeStruct:
        box = local_box(np.shape(leaf), sharding)
        return jax.ShapeDtypeStruct(tuple(b.stop - b.start for b in box), leaf_dtype(leaf))

    return jax.tree.map(one, template, per_leaf(shardings, template))


def slice_axes(mesh: Any, replica: str) -> tuple[str, ...]:
    """The axes of ``mesh`` inside a slice: every one but the replica axis, in mesh order."""
    return tuple(name for name in mesh.axis_names if name != replica)


def over_slice(sharding: Any, replica: str) -> bool:
    """Whether ``sharding`` splits an array over an axis inside a slice (across the processes of a slice)."""
    inside = set(slice_axes(sharding.mesh, replica))
    return any(inside & set(entry if isinstance(entry, tuple) else (entry,)) for entry in sharding.spec if entry)
