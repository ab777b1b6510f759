"""Mesh policies: shapes that fit the healthy devices, clear refusals, likely meshes, resharding."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from elastic_runtime import ElasticRuntime, MeshReduced, RunStarted, RuntimeConfig, read_events
from elastic_runtime.core.compiler import shardings_for
from elastic_runtime.core.errors import ConfigError, MeshUnavailable
from elastic_runtime.core.mesh import MeshPolicy, device_ids, mesh_shape
from elastic_runtime.testing.demo_model import demo_job


def devices(ids: list[int]) -> list[jax.Device]:
    by_id = {d.id: d for d in jax.devices()}
    return [by_id[i] for i in ids]


def test_the_data_axis_shrinks_and_the_model_axis_stays() -> None:
    policy = MeshPolicy({"data": 4, "model": 2}, slice_size=2)
    assert policy.shape_for(8) == {"data": 4, "model": 2}
    assert policy.shape_for(7) == {"data": 3, "model": 2}
    assert policy.shape_for(6) == {"data": 3, "model": 2}
    assert policy.shape_for(2) == {"data": 1, "model": 2}
    assert policy.shape_for(1) is None  # the model axis cannot shrink


def test_the_global_batch_stays_constant() -> None:
    policy = MeshPolicy({"data": 8}, global_batch=32)
    assert policy.shape_for(7) == {"data": 4}  # 7, 6 and 5 do not divide 32
    assert policy.shape_for(3) == {"data": 2}


def test_fit_uses_whole_slices_first_and_leaves_spares_out() -> None:
    policy = MeshPolicy({"data": 3, "model": 2}, slice_size=2)
    mesh = policy.fit(devices([0, 1, 3, 4, 5, 6, 7]))  # slice 1 is broken (device 2 is gone)
    assert mesh_shape(mesh) == {"data": 3, "model": 2}
    rows = [[d.id for d in row] for row in mesh.devices]
    assert rows == [[0, 1], [4, 5], [6, 7]]


def test_a_mesh_that_cannot_fit_is_refused_clearly() -> None:
    policy = MeshPolicy({"data": 2, "model": 4}, min_devices=4)
    with pytest.raises(MeshUnavailable, match=r"cannot be built from 3 healthy device\(s\): \[0, 1, 2\]"):
        policy.fit(devices([0, 1, 2]))
    with pytest.raises(MeshUnavailable, match="from 0 healthy"):
        policy.fit([])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"axes": {}}, "at least one axis"),
        ({"axes": {"data": 0}}, "size 0"),
        ({"axes": {"data": 2}, "shrinkable": ("model",)}, "'model' is not one of"),
        ({"axes": {"data": 4}, "global_batch": 10}, "not divisible"),
        ({"axes": {"data": 4}, "slice_size": 0}, "slice_size"),
    ],
)
def test_impossible_policies_are_config_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MeshPolicy(**kwargs)


def test_slices_of_names_only_whole_slices() -> None:
    policy = MeshPolicy({"data": 4, "model": 2}, slice_size=2)
    assert policy.slices_of([6, 7]) == (3,)
    assert policy.slices_of([2, 3, 4]) == (1,)
    assert policy.slices_of([5]) == ()


def test_likely_meshes_are_one_per_lost_slice() -> None:
    policy = MeshPolicy({"data": 4, "model": 2}, slice_size=2)
    mesh = policy.fit(jax.devices())
    candidates = policy.likely_meshes(mesh, jax.devices())
    assert len(candidates) == 4
    assert {device_ids(m) for m in candidates} == {tuple(i for i in range(8) if i // 2 != lost) for lost in range(4)}
    assert all(mesh_shape(m) == {"data": 3, "model": 2} for m in candidates)


def test_state_reshards_onto_a_smaller_mesh_unchanged() -> None:
    big = MeshPolicy({"data": 4, "model": 2}).fit(jax.devices())
    small = MeshPolicy({"data": 4, "model": 2}).fit(devices([0, 1, 2, 3, 4, 5]))
    specs = {"w": P(None, "model"), "b": P("model"), "x": P("data")}
    rng = np.random.default_rng(0)
    host = {
        "w": rng.standard_normal((6, 8)).astype(np.float32),
        "b": rng.standard_normal((8,)).astype(np.float32),
        "x": rng.standard_normal((12, 3)).astype(np.float32),
    }
    on_big = jax.device_put(host, shardings_for(specs, big))
    on_small = jax.device_put(jax.device_get(on_big), shardings_for(specs, small))
    for key in host:
        assert isinstance(on_small[key].sharding, NamedSharding)
        assert on_small[key].sharding.mesh.devices.size == 6
        np.testing.assert_array_equal(np.asarray(on_small[key]), host[key])


def test_a_run_that_starts_below_the_policys_shape_says_so(tmp_path: Path) -> None:
    config = RuntimeConfig(run_dir=str(tmp_path), precompile=False, scale_up_poll_s=None)
    policy = MeshPolicy({"data": 4, "model": 4}, global_batch=24)  # 16 devices asked for, 8 there
    ElasticRuntime(demo_job(global_batch=24, features=16, hidden=64), config=config, mesh_policy=policy).run(2)
    events = read_events(tmp_path / "events.jsonl")
    reduced = [e for e in events if isinstance(e, MeshReduced)]
    assert len(reduced) == 1
    assert reduced[0].target_shape == {"data": 4, "model": 4} and reduced[0].mesh_shape == {"data": 2, "model": 4}
    started = next(e for e in events if isinstance(e, RunStarted))
    assert started.mesh_shape == reduced[0].mesh_shape
