"""Silent data corruption, injected: one bit of one device's copy of a replicated leaf of the state flipped.

Used by the single-controller :class:`~elastic_runtime.testing.faults.FaultInjector` (``corrupt``) and by a
worker's own ``corrupt`` and ``corrupt-persistent`` faults (:mod:`elastic_runtime.faults.process`). A leaf is
replicated when two or more devices of its sharding hold the same block: in one process, the ``data`` axis's
replicas; under ``launch --slices``, the slices (each process holds its slice's copy).
"""

from __future__ import annotations

from typing import Any

__all__ = ["flip_a_bit"]


def flip_a_bit(state: Any, device: int) -> tuple[Any, bool]:
    """``state`` with one bit of ``device``'s copy of its first replicated 32-bit leaf flipped (``device`` one this
    process addresses), and whether ``device`` holds such a leaf at all. The state itself is left as it was."""
    import jax  # here: the controller imports the fault grammar's modules, and neither JAX nor numpy
    import numpy as np

    leaves, tree = jax.tree.flatten(state)
    for i, leaf in enumerate(leaves):
        blocks_of = leaf.sharding.devices_indices_map(leaf.shape)
        replicated = len({str(index) for index in blocks_of.values()}) < len(blocks_of)
        shards = leaf.addressable_shards
        if leaf.dtype.itemsize != 4 or not replicated or all(s.device.id != device for s in shards):
            continue
        blocks = []
        for shard in shards:
            block = shard.data
            if shard.device.id == device:
                words = np.array(block).reshape(-1).view(np.uint32)
                words[0] ^= 1 << 7
                block = jax.device_put(words.view(leaf.dtype).reshape(block.shape), shard.device)
            blocks.append(block)
        leaves[i] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, blocks)
        return jax.tree.unflatten(tree, leaves), True
    return state, False
