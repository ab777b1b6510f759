"""A worker's step writes its new state into the buffers of a replica replaced unread
(runtime/cluster/worker/spares.py): the step then takes no fresh memory and leaves the state it read whole; a
replica someone read, a state of an old group, or one that shares an array with the live state is never written
into."""

from __future__ import annotations

import gc
from typing import Any

import jax
import numpy as np

from elastic_runtime.cluster.worker.spares import SpareStates
from elastic_runtime.core.compiler import StepCompiler
from elastic_runtime.core.mesh import MeshPolicy
from elastic_runtime.storage.boxes import local_like
from elastic_runtime.storage.replicas import device_replica
from elastic_runtime.testing.demo_model import demo_job


def pointers(tree: Any) -> list[int]:
    return [shard.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards]


def setup() -> tuple[Any, Any, Any, Any]:
    job = demo_job(global_batch=24, features=16, hidden=64)
    mesh = MeshPolicy({"data": 4, "model": 2}, global_batch=24).fit(jax.devices())
    compiler = StepCompiler(job, job.init(), job.data.batch(0), into_spare=True)
    state = jax.device_put(job.init(), compiler.state_shardings(mesh))
    batch = jax.device_put(job.data.batch(0), compiler.batch_shardings(mesh))
    return job, mesh, compiler, (state, batch)


def test_the_step_writes_the_new_state_into_the_spare_and_keeps_the_state_it_read() -> None:
    job, mesh, compiler, (state, batch) = setup()
    plain = StepCompiler(job, job.init(), job.data.batch(0))
    expected, _ = plain.get(mesh)(state, batch)
    spare = compiler.fresh_buffers(mesh)
    before = pointers(spare)
    new_state, _ = compiler.get(mesh)(state, batch, spare)
    assert pointers(new_state) == before  # donated: no fresh memory
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(spare))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))  # a failed step could restore from it
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(new_state), jax.device_get(expected))


def test_a_replica_dropped_unread_is_the_next_steps_spare_and_a_read_one_is_not() -> None:
    _, mesh, compiler, (state, batch) = setup()
    spares = SpareStates()
    made: list[int] = []

    def fresh() -> Any:
        made.append(1)
        return compiler.fresh_buffers(mesh)

    spares.reset(1, fresh)
    like = local_like(state, compiler.state_shardings(mesh))
    step = compiler.get(mesh)
    first, _ = step(state, batch, spares.take(state))
    assert len(made) == 1
    replica = device_replica(1, 1, first, like, on_unread=spares.hand_back(1))
    first_pointers = pointers(first)
    second, _ = step(first, batch, spares.take(first))
    assert len(made) == 2  # the replica of step 1 still holds the state the step reads
    replica = device_replica(2, 2, second, like, on_unread=spares.hand_back(1))  # step 1's is dropped unread
    del first
    gc.collect()
    third, _ = step(second, batch, spares.take(second))
    assert len(made) == 2 and pointers(third) == first_pointers  # written into step 1's buffers
    np.asarray(replica.tree["params"]["w1"])  # read: its host copy may be held, so its state is no one's spare
    replica = device_replica(3, 3, third, like, on_unread=spares.hand_back(1))
    del second
    gc.collect()
    step(third, batch, spares.take(third))
    assert len(made) == 3


def test_a_spare_of_an_old_group_or_sharing_an_array_with_the_live_state_is_not_taken() -> None:
    _, mesh, compiler, (state, _) = setup()
    spares = SpareStates()
    fresh = compiler.fresh_buffers(mesh)
    spares.reset(1, lambda: fresh)
    old = spares.hand_back(1)
    spares.reset(2, lambda: fresh)
    old(compiler.fresh_buffers(mesh))  # handed back by a replica of generation 1, after the re-forming
    assert spares.take(state) is fresh
    # jit hands an input it returns unchanged back as the same array: such a spare is the live state too.
    shared = compiler.fresh_buffers(mesh)
    shared["params"]["w1"] = state["params"]["w1"]
    spares.hand_back(2)(shared)
    assert spares.take(state) is fresh
    own = compiler.fresh_buffers(mesh)
    spares.hand_back(2)(own)
    assert spares.take(state) is own
    spares.reset(3, None)
    assert not spares.on
