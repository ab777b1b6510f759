"""The RAM tier: complete host snapshots, copied once per piece of state; a failed copy keeps the previous one;
the buffers of a snapshot replaced unread are reused for the next copy, never those of one someone reads."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from elastic_runtime.core.compiler import StepCompiler, shardings_for
from elastic_runtime.core.errors import SnapshotUnavailable
from elastic_runtime.core.mesh import MeshPolicy
from elastic_runtime.core.snapshot import HostSnapshot, RamTier, host_sharding
from elastic_runtime.testing.demo_model import demo_job


def sharded_state(value: float) -> dict[str, jax.Array]:
    mesh = MeshPolicy({"data": 4, "model": 2}).fit(jax.devices())
    host = {
        "w": np.full((8, 16), value, np.float32) + np.arange(16, dtype=np.float32),
        "r": np.full((3,), value, np.float32),
    }
    return jax.device_put(host, shardings_for({"w": P("data", "model"), "r": P()}, mesh))


def test_a_snapshot_holds_the_full_state_step_and_data_position() -> None:
    ram = RamTier()
    seen: list[HostSnapshot] = []
    ram.listeners.append(seen.append)
    state = sharded_state(1.0)
    ram.capture(state, step=5, data_position=7, metadata={"note": "x"})
    snap = ram.latest()
    assert (snap.step, snap.data_position, snap.metadata) == (5, 7, {"note": "x"})
    np.testing.assert_array_equal(snap.tree["w"], np.asarray(state["w"]))
    np.testing.assert_array_equal(snap.tree["r"], np.asarray(state["r"]))
    assert snap.nbytes == 8 * 16 * 4 + 3 * 4
    assert seen == [snap]


def test_snapshots_are_independent_copies() -> None:
    ram = RamTier()
    ram.capture(sharded_state(1.0), step=1, data_position=1, metadata={})
    first = ram.latest()
    ram.capture(sharded_state(2.0), step=2, data_position=2, metadata={})
    second = ram.latest()
    assert first.tree["r"][0] == 1.0 and second.tree["r"][0] == 2.0  # the first was not overwritten


def test_a_failed_copy_leaves_the_previous_snapshot_and_is_reported() -> None:
    ram = RamTier()
    failures: list[tuple[int, str]] = []
    ram.failure_listeners.append(lambda step, exc: failures.append((step, str(exc))))
    ram.capture(sharded_state(1.0), step=1, data_position=1, metadata={})
    deleted = sharded_state(2.0)
    deleted["w"].delete()  # the copy of this state must fail, as if its device had died
    ram.capture(deleted, step=2, data_position=2, metadata={})
    snap = ram.latest()
    assert snap.step == 1 and snap.tree["r"][0] == 1.0
    assert len(failures) == 1 and failures[0][0] == 2 and "deleted" in failures[0][1]


def test_no_snapshot_yet_is_an_error() -> None:
    ram = RamTier()
    with pytest.raises(SnapshotUnavailable):
        ram.latest()


def test_the_host_copy_holds_each_piece_once() -> None:
    mesh = MeshPolicy({"data": 4, "model": 2}).fit(jax.devices())
    cases = {  # (device spec, shape) -> host spec: replicated axes go to the first dimension they divide
        (P(None, "model"), (256, 64)): P("data", "model"),
        (P("model"), (64,)): P(("model", "data")),
        (P(), (6, 8)): P("model", "data"),  # 6 does not divide by 4, so "data" takes the second dimension
        (P(), (3,)): P(None),  # nothing divides: replicated, still correct
    }
    for (spec, shape), expected in cases.items():
        sharding = host_sharding(NamedSharding(mesh, spec), shape)
        assert sharding.memory_kind == "pinned_host"
        assert sharding.spec == expected, (spec, shape, sharding.spec)


def test_a_snapshot_is_numpy_only_when_read_and_matches_the_state() -> None:
    ram = RamTier()
    state = sharded_state(3.0)
    ram.capture(state, step=1, data_position=1, metadata={})
    snap = ram.latest()
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(snap._tree))  # not assembled yet
    assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(snap.tree))
    np.testing.assert_array_equal(snap.tree["w"], np.asarray(state["w"]))


def host_copy(value: float) -> dict[str, jax.Array]:
    state = sharded_state(value)
    return jax.device_put(state, jax.tree.map(lambda x: host_sharding(x.sharding, x.shape), state))


def pointers(tree: dict[str, jax.Array]) -> list[int]:
    return [shard.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards]


def test_a_snapshot_replaced_unread_hands_its_buffers_back_and_a_read_one_does_not() -> None:
    ram = RamTier()
    first, second, third = host_copy(1.0), host_copy(2.0), host_copy(3.0)
    layout = jax.tree.map(lambda x: x.sharding, first)
    ram.commit(first, step=1, data_position=1, metadata={}, reuse=True)
    ram.commit(second, step=2, data_position=2, metadata={}, reuse=True)
    spare = ram.take_spare(layout)
    assert spare is not None and pointers(spare) == pointers(first)
    assert ram.take_spare(layout) is None  # handed out once
    ram.latest().tree  # noqa: B018  step 2 is read: numpy views may share its buffers
    ram.commit(third, step=3, data_position=3, metadata={}, reuse=True)
    assert ram.take_spare(layout) is None


def test_a_snapshot_still_held_by_a_reader_is_not_reused_until_dropped() -> None:
    ram = RamTier()
    layout = jax.tree.map(lambda x: x.sharding, host_copy(0.0))
    ram.commit(host_copy(1.0), step=1, data_position=1, metadata={}, reuse=True)
    held = ram.latest()  # a slower tier writing it out, say
    ram.commit(host_copy(2.0), step=2, data_position=2, metadata={}, reuse=True)
    assert ram.take_spare(layout) is None
    del held
    assert ram.take_spare(layout) is not None


def test_a_spare_of_another_layout_is_dropped() -> None:
    ram = RamTier()
    ram.commit(host_copy(1.0), step=1, data_position=1, metadata={}, reuse=True)
    ram.commit(host_copy(2.0), step=2, data_position=2, metadata={}, reuse=True)
    smaller = MeshPolicy({"data": 2, "model": 2}).fit(jax.devices()[:4])
    other = {"w": host_sharding(NamedSharding(smaller, P("data", "model")), (8, 16))}
    other["r"] = host_sharding(NamedSharding(smaller, P()), (3,))
    assert ram.take_spare(other) is None
    assert ram.take_spare(other) is None  # and it is gone, not kept for later


def test_the_fused_step_writes_its_host_copy_into_the_buffers_it_is_given() -> None:
    job = demo_job(global_batch=24, features=16, hidden=64)
    count = len(jax.devices())  # 8 CPU devices here; tests/benchmarks/gpu_check.sh runs it on one GPU too
    axes = {"data": 4, "model": 2} if count >= 8 else {"data": count, "model": 1}
    mesh = MeshPolicy(axes, global_batch=24).fit(jax.devices())
    initial = job.init()
    compiler = StepCompiler(job, initial, job.data.batch(0), host_copy=True)
    state = jax.device_put(initial, compiler.state_shardings(mesh))
    batch = jax.device_put(job.data.batch(0), compiler.batch_shardings(mesh))
    buffers = compiler.fresh_buffers(mesh)
    before = pointers(buffers)
    new_state, _, host = compiler.get(mesh)(state, batch, buffers)
    assert pointers(host) == before  # donated: no new host memory
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(buffers))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(host), jax.device_get(new_state))


@pytest.mark.parametrize("fused", [False, True], ids=["copy behind the step", "copy in the step"])
def test_what_a_snapshot_on_a_new_mesh_needs_is_compiled_ahead_with_its_step(
    fused: bool, compiles: list[float]
) -> None:
    # After a lost slice, the first step on the smaller mesh must not wait for a compile of its snapshot
    # copy (about 0.1 s on the demo, most of a recovery): the background compile of the mesh prepares it.
    job = demo_job(global_batch=24, features=16, hidden=64)
    compiler = StepCompiler(job, job.init(), job.data.batch(0), host_copy=fused)
    mesh = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2).fit(jax.devices()[:6])
    ram = RamTier()
    compiler.get(mesh)
    ram.prepare(compiler.state_abstract(mesh))
    state = jax.device_put(job.init(), compiler.state_shardings(mesh))
    compiles.clear()
    copied = compiler.fresh_buffers(mesh) if fused else ram.dispatch_copy(state, step=1)
    assert compiles == []
    assert copied is not None
    assert jax.tree.map(lambda x: x.sharding, copied) == compiler.host_shardings(mesh)
    if not fused:
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(state), strict=True))
    ram.close()


def test_a_spec_for_a_whole_subtree_gives_each_leaf_its_own_host_layout() -> None:
    # state_specs may be a prefix of the state (one spec for a whole subtree, as jit's shardings may be); the
    # copy into host memory still needs a layout per leaf, from each leaf's own shape.
    specs = {"params": P("data"), "momentum": P()}
    job = dataclasses.replace(demo_job(global_batch=24, features=16, hidden=64), state_specs=specs)
    compiler = StepCompiler(job, job.init(), job.data.batch(0), host_copy=True)
    mesh = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2).fit(jax.devices())
    host = compiler.host_shardings(mesh)
    assert jax.tree.structure(host) == jax.tree.structure(job.init())
    for part, spec in specs.items():
        for leaf, sharding in zip(jax.tree.leaves(job.init()[part]), jax.tree.leaves(host[part]), strict=True):
            assert sharding == host_sharding(NamedSharding(mesh, spec), leaf.shape)
    state = jax.device_put(job.init(), compiler.state_shardings(mesh))
    batch = jax.device_put(job.data.batch(0), compiler.batch_shardings(mesh))
    new_state, _, copy = compiler.get(mesh)(state, batch, compiler.fresh_buffers(mesh))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(copy), jax.device_get(new_state))
