"""The restore's broadcast (runtime/cluster/collectives.py): every slice's entry becomes the source slice's, by
collective permutes that send one way; bit for bit, for any number of slices and any source. On 8 CPU devices in
one process: the permutes are the same XLA collectives a group runs across processes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic_runtime.cluster.collectives import _broadcast


@pytest.mark.parametrize("slices", [1, 2, 3, 4, 8])
def test_every_slice_ends_with_the_source_slices_bits(slices: int) -> None:
    devices = np.array(jax.devices()[: 8 // slices * slices]).reshape(slices, -1)
    mesh = Mesh(devices, ("data", "model"))
    spec = PartitionSpec("data", "model")
    entries = np.arange(slices * devices.shape[1] * 6, dtype=np.uint32).reshape(slices, devices.shape[1] * 2, 3)
    entries[0, 0, 0] = 0x80000000  # -0.0 as float32: its bits must come through as they are
    stacked = jax.device_put(entries, NamedSharding(mesh, spec))
    for source in range(slices):
        moved = jax.jit(
            jax.shard_map(
                lambda entry, source=source: _broadcast(entry, source, slices, "data"),
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
                check_vma=False,
            )
        )(stacked)
        np.testing.assert_array_equal(np.asarray(moved), np.broadcast_to(entries[source], entries.shape))
