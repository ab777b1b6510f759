"""The compiled collectives that move a sharded state's shards between the processes of a group: a re-formed
group's restore from one source slice (:class:`SliceRestore`) and the neighbour replica (:class:`NeighbourShift`);
and the smallest of one number per process (:class:`GroupMinimum`, the script handlers' agreement at a boundary).

A re-formed group restores from one *source slice*: every process puts its box (or zeros, when it holds nothing
of that step) into a stacked array with one entry per slice, and the source slice's entries are sent to the
other slices by collective permutes over the replica axis, each shard from the source slice's process at the
same position to those of the other slices. No process ever holds more than its own shards. Which part of an
array a process holds (its box) is :mod:`elastic_runtime.storage.boxes`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from elastic_runtime.core.programs import ProgramStore, compile_kept
from elastic_runtime.storage.boxes import (
    Box,
    leaf_dtype,
    local_box,
    local_copy,
    over_slice,
    per_leaf,
    slice_axes,
    within,
)

__all__ = ["GroupMinimum", "NeighbourShift", "SliceRestore"]

PyTree = Any


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
            jax.ShapeDtypeStruct(np.shape(leaves[i]), leaf_dtype(leaves[i]), sharding=leaf_shardings[i])
            for i in self.moved
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


class GroupMinimum:
    """The smallest of one integer from each process of the group, known to every process: one compiled program
    over the first device of each process (``jax.experimental.multihost_utils.process_allgather`` did the same in
    2.2 ms a call between two processes on CPU, this in 0.7 ms: it builds its arrays and program anew each call).
    Built for the current backend: a re-formed group builds its own."""

    def __init__(self) -> None:
        firsts: dict[int, Any] = {}
        for device in sorted(jax.devices(), key=lambda d: d.id):
            firsts.setdefault(device.process_index, device)
        mesh = jax.sharding.Mesh(np.array([firsts[p] for p in sorted(firsts)]), ("process",))
        self.sharding = NamedSharding(mesh, PartitionSpec("process"))
        self.device = firsts[jax.process_index()]
        self.size = len(firsts)
        self.program = jax.jit(jnp.min, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def __call__(self, value: int) -> int:
        mine = jax.device_put(np.full((1,), value, np.int32), self.device)
        group = jax.make_array_from_single_device_arrays((self.size,), self.sharding, [mine])
        return int(np.asarray(self.program(group).addressable_data(0)))


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

    The shards move one way, from the source slice to the others (:func:`_broadcast`): an exchange in both
    directions (the all-gather XLA makes of selecting an entry by a traced index) took twice as long over gloo,
    which does not send and receive at once (128 MB over a 1 Gbit/s link: 2.08 s against 1.14 s). So the source
    is not an argument: a program per source slice, with and without neighbour copies, all compiled when it is
    built, at a group's forming: a restore never compiles.
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
        self._dtypes = [leaf_dtype(leaf) for leaf in leaves]
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
        self._programs = {
            (with_copies, source): self._compile(with_copies, source)
            for with_copies in {False, neighbours}
            for source in range(mesh.shape[replica])
        }

    def _compile(self, with_copies: bool, source: int) -> Any:
        mesh, specs, dtypes = self._mesh, self._specs, self._dtypes
        slices, size, per_process = self._grid_shape[0], self._grid_shape[1], _devices_per_process(mesh)
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

        def move(flags: jax.Array, stacked: list[jax.Array]) -> list[jax.Array]:
            # On each device: its entry of every stacked array, (1, *its shard's shape).
            own = take_back(flags, stacked) if with_copies else stacked
            # The entries travel as their bits (selected, never added: -0.0 stays -0.0) and become floats again.
            return [
                jax.lax.bitcast_convert_type(_broadcast(entry, source, slices, self._replica)[0], dtype)
                for entry, dtype in zip(own, dtypes, strict=True)
            ]

        stacked_specs = [spec for spec in specs for _ in range(2 if with_copies else 1)]
        leaf_specs = [sharding.spec for sharding in self._leaf_shardings]
        # Every slice's entry is the source's after the broadcast: each leaf is replicated over the replica axis.
        moved = jax.shard_map(
            move, mesh=mesh, in_specs=(self._grid.spec, stacked_specs), out_specs=leaf_specs, check_vma=False
        )

        def select(flags: jax.Array, stacked: list[jax.Array], where: jax.Array) -> list[Any]:
            return [*moved(flags, stacked), jnp.max(where[source])]

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
        )
        outputs = [*self._leaf_shardings, replicated]
        lower = jax.jit(select, out_shardings=outputs).lower
        name = f"restore from slice {source} (neighbours: {with_copies})"
        return _build(self._kept, name, mesh, lambda: lower(*arguments))

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
        chosen = self._programs[(from_neighbour, source)](missing, stacks, positions)
        state = jax.tree.unflatten(self._treedef, chosen[:-1])
        return state, int(np.asarray(chosen[-1].addressable_data(0)))


def _broadcast(entry: jax.Array, source: int, slices: int, axis: str) -> jax.Array:
    """Inside a shard_map: every slice's ``entry`` replaced by the ``source`` slice's, sent one way. Rounds of
    collective permutes over ``axis``, the slices holding it doubling each round (one permute for 2 slices):
    each round a permutation (a slice sends to one other), none sends back what it was sent."""
    index = jax.lax.axis_index(axis)
    have = 1
    while have < slices:
        pairs = [((source + i) % slices, (source + i + have) % slices) for i in range(min(have, slices - have))]
        received = jax.lax.ppermute(entry, axis, pairs)
        takes = jnp.any(jnp.array([index == to for _, to in pairs]))
        entry = jnp.where(takes, received, entry)
        have *= 2
    return entry


def _reader(mine: np.ndarray | None, box: Box, shape: tuple[int, ...], dtype: Any) -> Any:
    """The callback that fills a device's part of the stacked array: this process's box, or zeros."""

    bits = _bits(dtype)

    def read(index: Box) -> np.ndarray:
        part = within(index[1:], box, shape)
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
