"""A random-access dataset as the runtime's data source: a grain ``MapDataset``, or anything with ``len`` and
``[index]``.

The runtime asks for the global batch at a position (``DataSource.batch``), or under ``launch`` for a process's
rows of it (``ProcessBatches.rows``); a random-access dataset answers either without any iterator state to save,
so a restore to step ``k`` reads exactly the records it read the first time. Records are stacked leaf by leaf, so
a record may be an array or any pytree of arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.job import PyTree


class RandomAccess(Protocol):
    """What :class:`IndexedBatches` reads: a length and records by index (grain's ``MapDataset`` has both)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class IndexedBatches:
    """Global batch ``p`` is records ``p * global_batch`` to ``(p + 1) * global_batch - 1``, wrapping around the
    dataset (the next epoch repeats it in the same order; shuffle inside the dataset, by index, to vary it).

    Args:
        dataset: the records; ``dataset[i]`` must return the same record for the same ``i``.
        global_batch: records per batch.
    """

    def __init__(self, dataset: RandomAccess, global_batch: int) -> None:
        if global_batch < 1:
            raise ConfigError(f"IndexedBatches: global_batch must be >= 1, got {global_batch}")
        size = len(dataset)
        if size < 1:
            raise ConfigError("IndexedBatches: the dataset is empty")
        self.dataset = dataset
        self.global_batch = global_batch
        self.size = size

    def indices(self, position: int) -> list[int]:
        """The record indices of batch ``position``."""
        start = position * self.global_batch
        return [(start + k) % self.size for k in range(self.global_batch)]

    def batch(self, position: int) -> PyTree:
        """Global batch ``position``: the records of :meth:`indices`, each leaf stacked along a new first axis."""
        return self.rows(position, 0, self.global_batch)

    def rows(self, position: int, start: int, stop: int) -> PyTree:
        """Rows ``start`` to ``stop - 1`` of global batch ``position``: only their records are read (under
        ``launch``, a worker's share; :class:`~elastic_runtime.core.job.ProcessBatches`)."""
        first = position * self.global_batch
        records: Sequence[Any] = [self.dataset[(first + k) % self.size] for k in range(start, stop)]
        return jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *records)
