"""Mesh policies: which mesh to build from the healthy devices, and which degraded meshes are likely.

A policy names the target shape (``{"data": 4, "model": 2}``) and the axes that may shrink when devices are
lost (by default the data axis; the model axis keeps its size because the model's shards must still fit).
The global batch stays constant: when ``global_batch`` is set, the batch axis only takes sizes that divide
it, so each device's share of the batch is recomputed exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import Mesh

from elastic_runtime.core.errors import ConfigError, MeshUnavailable


def _as_axes(axes: Mapping[str, int] | Iterable[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    return tuple(axes.items()) if isinstance(axes, Mapping) else tuple(axes)


@dataclass(frozen=True)
class MeshPolicy:
    """How to lay devices out as a mesh, and how the mesh may shrink.

    Args:
        axes: target axis sizes, in mesh order (the last axis gets neighbouring devices).
        shrinkable: axes allowed to take a smaller size when devices are lost.
        batch_axis: the axis the global batch is split over.
        global_batch: when set, the batch axis size must divide it.
        slice_size: devices per failure domain (a TPU slice, a host); losses are reported per slice.
        min_devices: a mesh with fewer devices is refused.
    """

    axes: tuple[tuple[str, int], ...] | Mapping[str, int]
    shrinkable: tuple[str, ...] = ("data",)
    batch_axis: str = "data"
    global_batch: int | None = None
    slice_size: int = 1
    min_devices: int = 1
    _target: tuple[tuple[str, int], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        target = _as_axes(self.axes)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "shrinkable", tuple(self.shrinkable))
        names = [name for name, _ in target]
        if not target:
            raise ConfigError("mesh policy: axes must name at least one axis")
        if len(set(names)) != len(names):
            raise ConfigError(f"mesh policy: axis names repeat in {names}")
        for name, size in target:
            if not isinstance(size, int) or size < 1:
                raise ConfigError(f"mesh policy: axis {name!r} has size {size!r}, expected an int >= 1")
        for name in (*self.shrinkable, self.batch_axis):
            if name not in names:
                raise ConfigError(f"mesh policy: axis {name!r} is not one of {names}")
        if self.global_batch is not None and self.global_batch % self.target_shape[self.batch_axis]:
            raise ConfigError(
                f"mesh policy: global_batch {self.global_batch} is not divisible by "
                f"{self.batch_axis}={self.target_shape[self.batch_axis]}"
            )
        if self.slice_size < 1 or self.min_devices < 1:
            raise ConfigError("mesh policy: slice_size and min_devices must be >= 1")

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh axes, in the order the target shape gives them."""
        return tuple(name for name, _ in self._target)

    @property
    def target_shape(self) -> dict[str, int]:
        """The shape asked for with every device healthy, e.g. ``{"data": 4, "model": 2}``."""
        return dict(self._target)

    @property
    def target_size(self) -> int:
        """The number of devices the target shape uses."""
        return math.prod(size for _, size in self._target)

    def shape_for(self, available: int) -> dict[str, int] | None:
        """The largest allowed shape using at most ``available`` devices, or None if none fits."""
        choices: list[list[int]] = []
        for name, size in self._target:
            if name not in self.shrinkable:
                choices.append([size])
            elif name == self.batch_axis and self.global_batch is not None:
                choices.append([s for s in range(size, 0, -1) if self.global_batch % s == 0])
            else:
                choices.append(list(range(size, 0, -1)))
        best: tuple[int, ...] | None = None
        for combo in itertools.product(*choices):
            total = math.prod(combo)
            if self.min_devices <= total <= available and (best is None or total > math.prod(best)):
                best = combo
        return None if best is None else dict(zip(self.axis_names, best, strict=True))

    def fit(self, devices: Sequence[Any]) -> Mesh:
        """Build the largest allowed mesh over ``devices`` (healthy devices; spares are left out).

        Whole slices are used before partial ones, so the last mesh axis keeps neighbouring devices.

        Raises:
            MeshUnavailable: no allowed shape fits in ``len(devices)`` devices.
        """
        shape = self.shape_for(len(devices))
        if shape is None:
            fixed = {n: s for n, s in self._target if n not in self.shrinkable}
            raise MeshUnavailable(
                f"mesh policy {self.target_shape} (shrinkable {list(self.shrinkable)}, fixed {fixed}, "
                f"global_batch {self.global_batch}, min_devices {self.min_devices}) cannot be built from "
                f"{len(devices)} healthy device(s): {sorted(d.id for d in devices)}"
            )
        ordered = self._slice_order(devices)[: math.prod(shape.values())]
        grid = np.array(ordered, dtype=object).reshape(tuple(shape.values()))
        return Mesh(grid, self.axis_names)

    def _slice_order(self, devices: Sequence[Any]) -> list[Any]:
        by_slice: dict[int, list[Any]] = {}
        for device in sorted(devices, key=lambda d: d.id):
            by_slice.setdefault(device.id // self.slice_size, []).append(device)
        whole = [ds for ds in by_slice.values() if len(ds) == self.slice_size]
        partial = [ds for ds in by_slice.values() if len(ds) != self.slice_size]
        return [d for group in whole + partial for d in group]

    def slices_of(self, device_ids: Iterable[int]) -> tuple[int, ...]:
        """The slice indices that are entirely contained in ``device_ids``."""
        ids = set(device_ids)
        slices = {i // self.slice_size for i in ids}
        whole = (s for s in slices if all(s * self.slice_size + k in ids for k in range(self.slice_size)))
        return tuple(sorted(whole))

    def likely_meshes(self, mesh: Mesh, healthy: Sequence[Any]) -> list[Mesh]:
        """The meshes recovery would build if one slice of ``mesh`` were lost, most likely first."""
        in_use = sorted({d.id for d in mesh.devices.flat})
        seen = {mesh_key(mesh)}
        found = []
        for slice_index in sorted({i // self.slice_size for i in in_use}):
            lost = set(range(slice_index * self.slice_size, (slice_index + 1) * self.slice_size))
            try:
                candidate = self.fit([d for d in healthy if d.id not in lost])
            except MeshUnavailable:
                continue
            if mesh_key(candidate) not in seen:
                seen.add(mesh_key(candidate))
                found.append(candidate)
        return found


def mesh_key(mesh: Mesh) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """A hashable identity for a mesh: axis names, shape and device ids in layout order."""
    return (tuple(mesh.axis_names), tuple(mesh.devices.shape), tuple(int(d.id) for d in mesh.devices.flat))


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    return {str(name): int(size) for name, size in mesh.shape.items()}


def device_ids(mesh: Mesh) -> tuple[int, ...]:
    return tuple(sorted(int(d.id) for d in mesh.devices.flat))


@dataclass(frozen=True)
class ProcessMesh:
    """The mesh of a multi-process group (``elastic-runtime launch --slices S``): one replica axis across the
    group's slices, whose size is the number of slices and shrinks when one is lost, and the other axes inside
    a slice, spanning the devices of its processes.

    Args:
        axes: every axis in mesh order, with its size; the replica axis's size is ignored (the group sets it),
            and one other axis may be -1: the slice's devices left over by the others. MaxText's mesh, for
            example: ``{"data": -1, "stage": 1, "fsdp": -1, "tensor": 1, ...}``.
        replica_axis: the axis across slices. The state may not be split over it (it shrinks).

    Raises:
        ConfigError: the replica axis is not among the axes, a size is not an int >= 1 (or one -1), or more
            than one axis inside a slice is -1.
    """

    axes: tuple[tuple[str, int], ...] | Mapping[str, int] = (("data", -1), ("model", -1))
    replica_axis: str = "data"

    def __post_init__(self) -> None:
        axes = _as_axes(self.axes)
        object.__setattr__(self, "axes", axes)
        names = [name for name, _ in axes]
        if self.replica_axis not in names:
            raise ConfigError(f"process mesh: the replica axis {self.replica_axis!r} is not one of {names}")
        if len(set(names)) != len(names):
            raise ConfigError(f"process mesh: axis names repeat in {names}")
        inner = [(name, size) for name, size in axes if name != self.replica_axis]
        if any(not isinstance(size, int) or (size < 1 and size != -1) for _, size in inner):
            raise ConfigError(f"process mesh: sizes must be ints >= 1, or -1 for one axis: {dict(inner)}")
        if sum(size == -1 for _, size in inner) > 1:
            raise ConfigError(f"process mesh: more than one axis inside a slice is -1: {dict(inner)}")

    @property
    def slice_axes(self) -> tuple[str, ...]:
        """The axes inside a slice, in mesh order."""
        return tuple(name for name, _ in _as_axes(self.axes) if name != self.replica_axis)

    def build(self, devices: Sequence[Any], slices: int) -> Mesh:
        """The mesh of ``devices`` (ordered by process, a slice's processes together) in ``slices`` slices.

        Raises:
            MeshUnavailable: a slice's devices do not fill the axes' sizes.
        """
        axes = _as_axes(self.axes)
        per_slice = len(devices) // slices
        fixed = math.prod(size for name, size in axes if name != self.replica_axis and size != -1)
        open_axis = any(size == -1 for name, size in axes if name != self.replica_axis)
        if per_slice % fixed or (per_slice != fixed and not open_axis):
            raise MeshUnavailable(
                f"process mesh {dict(axes)}: a slice has {per_slice} devices, which the axes inside it "
                f"({', '.join(self.slice_axes)}) do not fill"
            )
        sizes = [per_slice // fixed if size == -1 else size for name, size in axes if name != self.replica_axis]
        grid = np.array(devices, dtype=object).reshape(slices, *sizes)
        at = [name for name, _ in axes].index(self.replica_axis)
        return Mesh(np.moveaxis(grid, 0, at), tuple(name for name, _ in axes))
