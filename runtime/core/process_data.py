"""A process's rows of each global batch: with a :class:`~elastic_runtime.core.job.ProcessBatches` data source, a worker
reads only the rows its devices hold under the batch's sharding on the current mesh, and the global batch is
built from every process's rows (``jax.make_array_from_process_local_data``). The rows follow the mesh: a
re-formed group (a shrunk data axis) hands each process another range, and every global batch is still seen
exactly once, as the same rows. A source without ``rows`` gives the global batch, and each process copies its
rows out of it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from elastic_runtime.core.job import DataSource, ProcessBatches, PyTree

__all__ = ["batch_example", "local_rows", "place_batch"]


def batch_example(data: DataSource) -> PyTree:
    """The shapes and dtypes of a global batch (``jax.ShapeDtypeStruct`` leaves); from one row where the source
    gives rows, so that no process reads a global batch to learn its shape."""
    if not isinstance(data, ProcessBatches):
        return jax.eval_shape(lambda: data.batch(0))
    one = jax.eval_shape(lambda: data.rows(0, 0, 1))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((data.global_batch, *x.shape[1:]), x.dtype), one)


def local_rows(shardings: PyTree, example: PyTree) -> tuple[int, int]:
    """The rows of the global batch this process's devices hold under ``shardings`` (a pytree prefix of the
    batch): from the first to the last any of its leaves needs."""
    starts, stops = [], []
    for sharding, leaf in zip(_per_leaf(shardings, example), jax.tree.leaves(example), strict=True):
        for index in sharding.addressable_devices_indices_map(leaf.shape).values():
            first = index[0] if index else slice(None)
            start, stop, _ = first.indices(leaf.shape[0])
            starts.append(start)
            stops.append(stop)
    return min(starts), max(stops)


def place_batch(
    data: DataSource, position: int, shardings: PyTree, example: PyTree, rows: tuple[int, int]
) -> tuple[PyTree, int]:
    """The global batch at ``position`` on the devices, as ``shardings`` lay it out, and the bytes read from
    ``data`` for it: only this process's ``rows`` where ``data`` gives rows, else the global batch."""
    if not isinstance(data, ProcessBatches):
        batch = data.batch(position)
        return _from_global(batch, shardings), sum(np.asarray(x).nbytes for x in jax.tree.leaves(batch))
    start, stop = rows
    local = data.rows(position, start, stop)
    leaves = [
        _from_rows(np.asarray(x), sharding, like.shape, start)
        for x, sharding, like in zip(
            jax.tree.leaves(local), _per_leaf(shardings, example), jax.tree.leaves(example), strict=True
        )
    ]
    return jax.tree.unflatten(jax.tree.structure(example), leaves), sum(x.nbytes for x in jax.tree.leaves(local))


def _from_rows(local: np.ndarray, sharding: Any, shape: tuple[int, ...], start: int) -> jax.Array:
    # Each device's index is into the global batch; this process's rows start at ``start``.
    def shard(index: tuple[slice, ...] | None) -> np.ndarray:
        first, *rest = index or (slice(None),)
        lo, hi, _ = first.indices(shape[0])
        return local[(slice(lo - start, hi - start), *rest)]

    return jax.make_array_from_callback(shape, sharding, shard)


def _from_global(batch: PyTree, shardings: PyTree) -> PyTree:
    def one(sharding: Any, subtree: PyTree) -> PyTree:
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x)[idx]), subtree
        )

    return jax.tree.map(one, shardings, batch)


def _per_leaf(shardings: PyTree, tree: PyTree) -> list[Any]:
    """``shardings`` (a prefix of ``tree``) repeated for every leaf of ``tree``."""
    return jax.tree.leaves(jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), shardings, tree))
