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

from runtime.core.errors import ConfigError, MeshUnavailable


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
