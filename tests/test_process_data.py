"""A process's rows of each global batch (runtime/core/process_data.py) and IndexedBatches reading only them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from elastic_runtime import IndexedBatches
from elastic_runtime.core.process_data import batch_example, local_rows, place_batch


class Counted:
    """Records ``{"x": [i, i]}``; remembers which were read."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.read: list[int] = []

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        self.read.append(index)
        return {"x": np.array([index, index], np.int32)}


def test_indexed_batches_read_only_the_rows_asked_for() -> None:
    records = Counted(10)
    data = IndexedBatches(records, global_batch=8)
    whole = data.batch(3)["x"]
    records.read.clear()
    part = data.rows(3, 2, 5)["x"]
    assert records.read == [(3 * 8 + k) % 10 for k in range(2, 5)]
    np.testing.assert_array_equal(part, whole[2:5])


def test_the_batch_built_from_rows_equals_the_one_built_from_the_global_batch() -> None:
    data = IndexedBatches(Counted(50), global_batch=8)
    example = batch_example(data)
    assert example["x"].shape == (8, 2)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    shardings = {"x": NamedSharding(mesh, P(("data", "model")))}
    rows = local_rows(shardings, example)
    assert rows == (0, 8)  # one process: every device is its own
    from_rows, read = place_batch(data, 1, shardings, example, rows)

    class Global:
        def batch(self, position: int) -> Any:
            return data.batch(position)

    from_global, read_global = place_batch(Global(), 1, shardings, example, rows)
    np.testing.assert_array_equal(np.asarray(from_rows["x"]), np.asarray(from_global["x"]))
    assert read == read_global == 8 * 2 * 4
