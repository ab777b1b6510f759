"""A process's own shards of a state sharded over slices of processes, and a restore that moves only shards.

The multi-process mesh has one replica axis across slices (``data`` by default; each slice a fixed group of
processes holding one full copy of the state) and its other axes (``model`` by default, or a model's own:
``fsdp``, ``tensor``, ...) span the devices of every process of a slice, so a state sharded over them is
sharded across the processes of a slice (:class:`~elastic_runtime.core.mesh.ProcessMesh`). With one process per slice
(the default) every process holds the whole state.

Each process copies to host memory only what it holds: for every array the smallest box of global indices
that covers its shards (:func:`local_box`, :func:`local_copy`). Processes at the same position of different
slices hold the same boxes, so a slice is its neighbours' replica, shard for shard.

A re-formed group restores from one *source slice* (:class:`SliceRestore`): every process puts its box
(or zeros, when it holds nothing of that step) into a stacked array with one entry per slice, and one jitted
selection of the source's entry moves each shard from the source slice's process at the same position
(XLA's collectives over the replica axis). No process ever holds more than its own shards.
"""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from elastic_runtime.core.errors import SnapshotUnavailable
from elastic_runtime.core.programs import ProgramStore, compile_kept

__all__ = [
    "NeighbourShift",
    "SliceRestore",
    "local_box",
    "local_copy",
    "local_like",
    "over_slice",
    "per_leaf",
    "uses_axis",
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


def _dtype(leaf: Any) -> np.dtype[Any]:
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


def _within(index: Box, box: Box, shape: tuple[int, ...]) -> Box:
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
            out[_within(shard.index, box, leaf.shape)] = np.asarray(shard.data)
    return out


def local_like(template: PyTree, shardings: PyTree) -> PyTree:
    """Shapes and dtypes of this process's boxes of ``template`` under ``shardings`` (what :func:`local_copy`
    returns on that layout): what a replica file of this process must hold."""

    def one(leaf: Any, sharding: Any) -> jax.ShapeDtypeStruct:
        box = local_box(np.shape(leaf), sharding)
        return jax.ShapeDtypeStruct(tuple(b.stop - b.start for b in box), _dtype(leaf))

    return jax.tree.map(one, template, per_leaf(shardings, template))


def slice_axes(mesh: Any, replica: str) -> tuple[str, ...]:
    """The axes of ``mesh`` inside a slice: every one but the replica axis, in mesh order."""
    return tuple(name for name in mesh.axis_names if name != replica)


def over_slice(sharding: Any, replica: str) -> bool:
    """Whether ``sharding`` splits an array over an axis inside a slice (across the processes of a slice)."""
    inside = set(slice_axes(sharding.mesh, replica))
    return any(inside & set(entry if isinstance(entry, tuple) else (entry,)) for entry in sharding.spec if entry)


class NeighbourShift:
    """The neighbour replica: each process also keeps, in host memory, the shards of the process before it in
    its slice (position ``p - 1``, wrapping around), so a lost process's shards usually survive in its
    neighbour (Orbax emergency checkpointing's peer replica, Gemini's in-memory checkpoints).

    One collective permute over the axes inside a slice per step moves each process's shards of every leaf
    split over them to the next process; a leaf that is not split is held whole by every process, so its neighbour
    copy is the process's own. Compiled when built (a group's forming), never in a step or a restore.
    """

    def __init__(
        self, template: PyTree, shardings: PyTree, *, replica: str = "data", programs: ProgramStore | None = None
    ) -> None:
        leaf_shardings: list[Any] = jax.tree.leaves(per_leaf(shardings, template))
        self.moved = [i for i, sharding in enumerate(leaf_shardings) if over_slice(sharding, replica)]
        if not self.moved:
            self._shift = None
            return
        mesh = leaf_shardings[0].mesh
        inside = slice_axes(mesh, replica)
        size, per_process = _slice_devices(mesh, inside), _devices_per_process(mesh)
        forward = [(j, (j + per_process) % size) for j in range(size)]
        specs = [leaf_shardings[i].spec for i in self.moved]

        def shift(leaves: list[jax.Array]) -> list[jax.Array]:
            return [jax.lax.ppermute(leaf, inside, forward) for leaf in leaves]

        mapped = jax.shard_map(shift, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False)
        leaves = jax.tree.leaves(template)
        shapes = [
            jax.ShapeDtypeStruct(np.shape(leaves[i]), _dtype(leaves[i]), sharding=leaf_shardings[i]) for i in self.moved
        ]
        self._shift = _build(programs, "neighbour shift", mesh, lambda: jax.jit(mapped).lower(shapes))

    def __call__(self, state: PyTree) -> list[jax.Array]:
        """The neighbour's shards of the leaves split inside a slice, on this process's devices. A collective:
        every process of the group calls it with the same step's state."""
        if self._shift is None:
            return []
        leaves = jax.tree.leaves(state)
        moved: list[jax.Array] = self._shift([leaves[i] for i in self.moved])
        return jax.block_until_ready(moved)

    def copy(self, moved: list[jax.Array], own: PyTree) -> PyTree:
        """The neighbour replica in host memory: ``moved`` (from :meth:`__call__`) copied in place of the
        split leaves of ``own`` (this process's :func:`local_copy` of the same step), whose other leaves are
        the neighbour's too."""
        leaves, treedef = jax.tree.flatten(own)
        for i, leaf in zip(self.moved, moved, strict=True):
            leaves[i] = local_copy(leaf)
        return jax.tree.unflatten(treedef, leaves)


def _build(programs: ProgramStore | None, name: str, mesh: Any, lower: Any) -> Any:
    """``lower()`` compiled, or loaded from ``programs`` when kept there for this layout: a re-formed group on
    the layout of an earlier one does not trace or compile it again."""
    return compile_kept(programs, name, mesh, jax.process_index(), lower)


def _devices_per_process(mesh: Any) -> int:
    devices = list(mesh.devices.flat)
    return sum(d.process_index == devices[0].process_index for d in devices)


def _slice_devices(mesh: Any, inside: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[name] for name in inside)


class SliceRestore:
    """The restore of a group: the state on ``shardings``' mesh, taken from one source slice.

    A collective over the group: every process calls it with the same ``source``, each with its own
    :func:`local_copy` of the step (or None when it holds nothing of it, or is outside the source slice); only
    the source slice's boxes are read, and each process receives only its own shards. With neighbour replicas
    (:class:`NeighbourShift`), a process of the source slice whose shards are missing takes them from the next
    process's neighbour copy: one collective permute back over the axes inside a slice, then the source's selection.

    The programs (with and without neighbour copies, the source an argument) are compiled when it is built, at
    a group's forming: a restore never compiles.
    """

    def __init__(
        self,
        template: PyTree,
        shardings: PyTree,
        *,
        neighbours: bool,
        replica: str = "data",
        programs: ProgramStore | None = None,
    ) -> None:
        leaves, self._treedef = jax.tree.flatten(template)
        self._leaf_shardings: list[Any] = jax.tree.leaves(per_leaf(shardings, template))  # NamedShardings: leaves
        mesh = self._mesh = self._leaf_shardings[0].mesh
        self._replica, self._inside = replica, slice_axes(mesh, replica)
        self._shapes = [np.shape(leaf) for leaf in leaves]
        self._dtypes = [_dtype(leaf) for leaf in leaves]
        self._specs = [
            PartitionSpec(replica, *tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec)))
            for sharding, shape in zip(self._leaf_shardings, self._shapes, strict=True)
        ]
        # One entry per (slice, device of the slice): the group's devices as a grid.
        self._grid = NamedSharding(mesh, PartitionSpec(replica, self._inside))
        self._grid_shape = (mesh.shape[replica], _slice_devices(mesh, self._inside))
        # Asked now, at forming: a restore abandoned when the group re-forms must not ask JAX (a new backend).
        self._process = jax.process_index()
        self._kept = programs
        self._programs = {with_copies: self._compile(with_copies) for with_copies in {False, neighbours}}

    def _compile(self, with_copies: bool) -> Any:
        mesh, specs, dtypes = self._mesh, self._specs, self._dtypes
        size, per_process = self._grid_shape[1], _devices_per_process(mesh)
        backward = [(j, (j - per_process) % size) for j in range(size)]

        def take_back(flags: jax.Array, pairs: list[jax.Array]) -> list[jax.Array]:
            # Every device of a process that misses its shards takes those its next neighbour keeps of them.
            return [
                jax.lax.select(
                    jnp.broadcast_to(flags.reshape((1,) * own.ndim), own.shape),
                    jax.lax.ppermute(copy, self._inside, backward),
                    own,
                )
                for own, copy in zip(pairs[0::2], pairs[1::2], strict=True)
            ]

        def select(flags: jax.Array, stacked: list[jax.Array], where: jax.Array, source: jax.Array) -> list[Any]:
            if with_copies:
                paired = [spec for spec in specs for _ in (0, 1)]
                stacked = jax.shard_map(
                    take_back, mesh=mesh, in_specs=(self._grid.spec, paired), out_specs=specs, check_vma=False
                )(flags, stacked)
            # XLA may select by summing masked entries (a reduction over the replica axis): in floats -0.0 + 0.0
            # is +0.0. The entries travel as their bits, where adding zeros changes nothing, and become floats
            # again here.
            chosen = [
                jax.lax.bitcast_convert_type(jax.lax.dynamic_index_in_dim(a, source, keepdims=False), dtype)
                for a, dtype in zip(stacked, dtypes, strict=True)
            ]
            return [*chosen, jnp.max(jax.lax.dynamic_index_in_dim(where, source, keepdims=False))]

        slices = mesh.shape[self._replica]
        stacked = [
            jax.ShapeDtypeStruct((slices, *shape), _bits(dtype), sharding=NamedSharding(mesh, spec))
            for shape, dtype, spec in zip(self._shapes, dtypes, specs, strict=True)
            for _ in range(2 if with_copies else 1)
        ]
        grid = self._grid_shape
        replicated = NamedSharding(mesh, PartitionSpec())
        arguments = (
            jax.ShapeDtypeStruct(grid, np.bool_, sharding=self._grid),
            stacked,
            jax.ShapeDtypeStruct(grid, np.int32, sharding=self._grid),
            jax.ShapeDtypeStruct((), np.int32, sharding=replicated),
        )
        outputs = [*self._leaf_shardings, replicated]
        lower = jax.jit(select, out_shardings=outputs).lower
        return _build(self._kept, f"restore (neighbours: {with_copies})", mesh, lambda: lower(*arguments))

    def __call__(
        self,
        boxes: PyTree | None,
        position: int,
        *,
        source: int,
        neighbour: PyTree | None = None,
        neighbour_position: int = -1,
        from_neighbour: bool = False,
    ) -> tuple[PyTree, int]:
        """The restored state and the source's data position. ``position`` and ``neighbour_position`` are the
        data positions of ``boxes`` and ``neighbour``; ``from_neighbour`` is the same on every process."""
        mesh, n = self._mesh, len(self._shapes)
        held: list[Any] = jax.tree.leaves(boxes) if boxes is not None else [None] * n
        spares: list[Any] = jax.tree.leaves(neighbour) if neighbour is not None else [None] * n
        stacks = []
        for shape, dtype, sharding, spec, mine, spare in zip(
            self._shapes, self._dtypes, self._leaf_shardings, self._specs, held, spares, strict=True
        ):
            box = local_box(shape, sharding, self._process)
            stack, stacked_sharding = (mesh.shape[self._replica], *shape), NamedSharding(mesh, spec)
            stacks.append(jax.make_array_from_callback(stack, stacked_sharding, _reader(mine, box, shape, dtype)))
            if from_neighbour:
                stacks.append(jax.make_array_from_callback(stack, stacked_sharding, _reader(spare, box, shape, dtype)))
        grid = self._grid_shape
        # The data position: every device says its process's (-1: none); the source slice's largest is its own.
        mine_position = position if boxes is not None else neighbour_position if from_neighbour else -1
        positions = jax.make_array_from_callback(grid, self._grid, lambda _: np.full((1, 1), mine_position, np.int32))
        # Which devices take their shards from the neighbour copy: those of processes holding nothing of the step.
        missing = jax.make_array_from_callback(grid, self._grid, lambda _: np.full((1, 1), boxes is None, np.bool_))
        chosen = self._programs[from_neighbour](missing, stacks, positions, np.int32(source))
        state = jax.tree.unflatten(self._treedef, chosen[:-1])
        return state, int(np.asarray(chosen[-1].addressable_data(0)))


def _reader(mine: np.ndarray | None, box: Box, shape: tuple[int, ...], dtype: Any) -> Any:
    """The callback that fills a device's part of the stacked array: this process's box, or zeros."""

    bits = _bits(dtype)

    def read(index: Box) -> np.ndarray:
        part = _within(index[1:], box, shape)
        if mine is None:
            return np.zeros((1, *(s.stop - s.start for s in part)), bits)
        return np.ascontiguousarray(np.asarray(mine)[part][None]).view(bits)

    return read


def _bits(dtype: Any) -> np.dtype[Any]:
    """How an array of ``dtype`` travels through the selection: floats of 16 and 32 bits as unsigned
    integers of their width (their bits, moved without arithmetic); integers and booleans as they are (exact
    anyway); wider types as they are (64-bit integers would need JAX's x64 mode)."""
    dtype = np.dtype(dtype)
    return np.dtype(f"u{dtype.itemsize}") if dtype.kind not in "iub" and dtype.itemsize in (2, 4) else dtype
