"""The step is compiled under the mesh it is compiled for, and its example state may hold typed PRNG keys."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from elastic_runtime.core.compiler import StepCompiler, abstract
from elastic_runtime.core.job import TrainJob
from elastic_runtime.testing.demo_model import TeacherData


def _step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    # A bare PartitionSpec, as real models write them: it needs the mesh the step is traced for.
    x = jax.lax.with_sharding_constraint(batch["x"], P("data"))
    seen = dict(jax.sharding.get_abstract_mesh().shape)
    return {"w": state["w"] + x.sum(), "seen": jnp.full((), seen.get("data", 0))}, {"loss": x.mean()}


def _job() -> TrainJob:
    init = {"w": np.zeros((), np.float32), "seen": np.zeros((), np.int32)}
    return TrainJob(init=lambda: init, step=_step, data=TeacherData(global_batch=8, features=4), state_specs=P())


@pytest.mark.parametrize("rows", [4, 2])
def test_the_step_is_traced_under_the_mesh_it_is_compiled_for(rows: int) -> None:
    job = _job()
    compiler = StepCompiler(job, job.init(), job.data.batch(0))
    mesh = Mesh(np.array(jax.devices()[: rows * 2]).reshape(rows, 2), ("data", "model"))
    compiled = compiler.get(mesh)
    state = jax.device_put(job.init(), compiler.state_shardings(mesh))
    batch = jax.device_put(job.data.batch(0), compiler.batch_shardings(mesh))
    new_state, _ = compiled(state, batch)
    assert int(new_state["seen"]) == rows  # the mesh the step saw while traced
    assert jax.sharding.get_abstract_mesh().empty  # and the caller's context is as it was


def test_a_typed_prng_key_has_its_own_dtype_in_the_abstract_state() -> None:
    shapes = abstract({"key": jax.random.key(0), "w": np.zeros((3,), np.float32)})
    assert jax.dtypes.issubdtype(shapes["key"].dtype, jax.dtypes.prng_key)
    assert shapes["w"] == jax.ShapeDtypeStruct((3,), np.float32)


def test_the_abstract_state_has_a_sharding_for_every_leaf_when_the_specs_are_a_prefix() -> None:
    # One P() for the whole state, TrainJob's default: what compiling ahead and the RAM tier's copy are compiled from
    # (it failed with a pytree structure error, and every compile ahead with it, logged, not raised).
    job = _job()
    compiler = StepCompiler(job, job.init(), job.data.batch(0))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    shapes = compiler.state_abstract(mesh)
    assert set(shapes) == {"w", "seen"}
    assert all(leaf.sharding.spec == P() and leaf.sharding.mesh == mesh for leaf in jax.tree.leaves(shapes))
