"""IndexedBatches: a random-access dataset (a list, a grain MapDataset) as the runtime's data source."""

from __future__ import annotations

import grain
import numpy as np
import pytest

from elastic_runtime import ConfigError, IndexedBatches


def record(index: int) -> dict[str, np.ndarray]:
    return {"tokens": np.full(3, index, np.int32), "label": np.float32(index) / 2}


def test_batch_p_holds_records_p_times_b_onward_and_wraps_around() -> None:
    batches = IndexedBatches([record(i) for i in range(10)], global_batch=4)
    assert batches.batch(0)["tokens"][:, 0].tolist() == [0, 1, 2, 3]
    assert batches.batch(1)["tokens"][:, 0].tolist() == [4, 5, 6, 7]
    assert batches.batch(2)["tokens"][:, 0].tolist() == [8, 9, 0, 1]  # the next epoch, same order
    assert batches.batch(2)["tokens"].shape == (4, 3) and batches.batch(2)["label"].dtype == np.float32


def test_a_grain_map_dataset_gives_the_same_batches_as_the_list_it_reads() -> None:
    records = [record(i) for i in range(10)]
    dataset = grain.MapDataset.source(records).map(lambda r: {**r, "tokens": r["tokens"] + 1})
    from_grain = IndexedBatches(dataset, global_batch=3)
    plain = IndexedBatches(records, global_batch=3)
    for position in (0, 1, 5):
        got, want = from_grain.batch(position), plain.batch(position)
        np.testing.assert_array_equal(got["tokens"], want["tokens"] + 1)
        np.testing.assert_array_equal(got["label"], want["label"])
        np.testing.assert_array_equal(from_grain.batch(position)["tokens"], got["tokens"])  # asked again: same


@pytest.mark.parametrize(("records", "global_batch", "message"), [([], 2, "empty"), ([1, 2], 0, "global_batch")])
def test_an_empty_dataset_or_batch_size_is_refused(records: list[int], global_batch: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        IndexedBatches(records, global_batch)
