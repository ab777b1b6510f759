"""A step compiled for one mesh runs on another mesh of the same shape without a compile of its own, and gives
the same bits as its own compile would (elastic_runtime.core.same_shape)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from elastic_runtime.core.compiler import StepCompiler
from elastic_runtime.core.job import TrainJob
from elastic_runtime.core.programs import ProgramStore
from elastic_runtime.testing.demo_model import TeacherData, demo_job
from elastic_runtime.testing.fresh_process import run_with_compile_cache


def _mesh(first: int) -> Mesh:
    """Six of the eight devices, from ``first`` on, as 3 x 2: the mesh left when a slice is lost."""
    return Mesh(np.array(jax.devices()[first : first + 6]).reshape(3, 2), ("data", "model"))


def _run(compiler: StepCompiler, job: TrainJob, mesh: Mesh, steps: int = 3) -> list[np.ndarray]:
    state = jax.device_put(job.init(), compiler.state_shardings(mesh))
    step = compiler.get(mesh)
    for i in range(steps):
        batch = jax.device_put(job.data.batch(i), compiler.batch_shardings(mesh))
        args = (state, batch, compiler.fresh_buffers(mesh)) if compiler.host_copy else (state, batch)
        state, *_ = step(*args)
    assert {d.id for leaf in jax.tree.leaves(state) for d in leaf.sharding.device_set} == {
        d.id for d in mesh.devices.flat
    }
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


def test_a_second_mesh_of_the_same_shape_loads_the_first_ones_step_and_computes_the_same_bits(
    compiles: list[float],
) -> None:
    job = demo_job(features=32, hidden=64)
    # The fused host copy, as a single process runs by default: the step and its host buffers' maker.
    shared = StepCompiler(job, job.init(), job.data.batch(0), host_copy=True)
    shared.get(_mesh(0))
    compiled_first = len(compiles)
    assert compiled_first >= 2
    moved = _run(shared, job, _mesh(2))
    assert len(compiles) == compiled_first  # no compile for the second mesh
    assert shared.same_shape.loaded == {tuple(range(2, 8)): 2}  # the step and its host buffers' maker

    own = StepCompiler(job, job.init(), job.data.batch(0), host_copy=True)
    expected = _run(own, job, _mesh(2))
    assert len(compiles) > compiled_first
    assert all(np.array_equal(a, b) for a, b in zip(moved, expected, strict=True))


def test_a_kept_program_serves_a_layout_of_its_shape_never_compiled_for_and_computes_the_same_bits(
    compiles: list[float],
) -> None:
    # As a group one slice smaller loads what its members compiled on the old backend (worker/smaller.py). A
    # model of its own: JAX keeps compiled programs in memory too, by program and devices.
    job = demo_job(features=16, hidden=48)
    kept = ProgramStore()
    StepCompiler(job, job.init(), job.data.batch(0), programs=kept, place=(0, 4)).get(_mesh(0))
    assert kept.traced == ["step"] and kept.loaded == []
    compiled_first = len(compiles)

    kept.reset()
    moved = _run(StepCompiler(job, job.init(), job.data.batch(0), programs=kept, place=(0, 3)), job, _mesh(2))
    assert len(compiles) == compiled_first
    assert kept.traced == [] and kept.loaded == ["step"]
    expected = _run(StepCompiler(job, job.init(), job.data.batch(0)), job, _mesh(2))
    assert len(compiles) > compiled_first
    assert all(np.array_equal(a, b) for a, b in zip(moved, expected, strict=True))

    other = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))  # another shape: compiled
    kept.reset()
    StepCompiler(job, job.init(), job.data.batch(0), programs=kept, place=(0, 3)).get(other)
    assert kept.traced == ["step"]


def test_a_mesh_whose_step_lowers_differently_is_compiled_on_its_own(compiles: list[float]) -> None:
    def step_on(mesh: Mesh) -> Any:
        first = int(mesh.devices.flat[0].id)  # a step built for its concrete mesh, as some models are

        def step(state: dict[str, jax.Array], batch: dict[str, jax.Array]) -> tuple[Any, Any]:
            return {"w": state["w"] + first + batch["x"].sum()}, {"loss": batch["x"].mean()}

        return step

    job = TrainJob(
        init=lambda: {"w": np.zeros((), np.float32)},
        step=None,
        data=TeacherData(global_batch=12, features=4),
        state_specs=P(),
        step_for_mesh=step_on,
    )
    compiler = StepCompiler(job, job.init(), job.data.batch(0))
    compiler.get(_mesh(0))
    compiled_first = len(compiles)
    (w,) = _run(compiler, job, _mesh(2), steps=1)
    assert len(compiles) > compiled_first
    assert compiler.same_shape.loaded == {}
    assert np.isclose(float(w), 2 + float(jnp.sum(job.data.batch(0)["x"])))  # its own device 2, not device 0


def test_meshes_compiled_at_once_share_one_compile(compiles: list[float]) -> None:
    job = demo_job(features=32, hidden=64)
    compiler = StepCompiler(job, job.init(), job.data.batch(0))
    threads = [threading.Thread(target=compiler.get, args=(_mesh(first),)) for first in (0, 1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(compiles) == 1
    assert sum(compiler.same_shape.loaded.values()) == 2
    assert all(compiler.is_ready(_mesh(first)) for first in (0, 1, 2))


RESUMED = """
import json
import jax, numpy as np
from jax.sharding import Mesh
from elastic_runtime.core.compiler import StepCompiler
from elastic_runtime.testing.demo_model import demo_job

jax.config.update("jax_num_cpu_devices", 8)
job = demo_job(features=32, hidden=64)
mesh = lambda first: Mesh(np.array(jax.devices()[first : first + 6]).reshape(3, 2), ("data", "model"))

def run(compiler, first):
    m = mesh(first)
    state = jax.device_put(job.init(), compiler.state_shardings(m))
    batch = jax.device_put(job.data.batch(0), compiler.batch_shardings(m))
    return [np.asarray(x).tolist() for x in jax.tree.leaves(compiler.get(m)(state, batch)[0])]

first = StepCompiler(job, job.init(), job.data.batch(0))
expected = run(first, 2)  # mesh 0's step was never compiled: mesh 2's is in the cache
jax.clear_caches()
resumed = StepCompiler(job, job.init(), job.data.batch(0))
out = {"cached_runs": run(resumed, 2) == expected}
out["compiled_runs"] = run(resumed, 0) is not None
out["loaded_runs"] = run(resumed, 1) is not None
out["loaded"] = sum(resumed.same_shape.loaded.values())
print("RESULT " + json.dumps(out))
"""


def test_in_a_resumed_run_the_first_mesh_compiled_for_real_serves_the_rest(tmp_path: Path) -> None:
    # The first mesh's step comes from JAX's persistent cache, which cannot be serialized whole on CPU
    # (tests/test_programs_cache.py): the next mesh compiles, and the one after loads that one's step.
    out = run_with_compile_cache(RESUMED, tmp_path / "cache")
    assert out == {"cached_runs": True, "compiled_runs": True, "loaded_runs": True, "loaded": 1}, out
