"""A job shaped like a real model's (``elastic_runtime.testing.keyed_model``): typed PRNG keys in the state, its own
mesh axes, a step built per concrete mesh, nested metrics. In one process: a lost slice, the disk tier and a
resume, each compared with a fault-free run; every trace of the step ran under its own mesh, the background
compiles' included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig, TrainJob
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.keys import KeyLeaves, with_key_data
from elastic_runtime.core.mesh import ProcessMesh
from elastic_runtime.testing import FaultInjector
from elastic_runtime.testing.keyed_model import keyed_job

STEPS = 16
POLICY = MeshPolicy({"data": 4, "fsdp": 2, "tensor": 1}, global_batch=96, slice_size=2)


def run(
    tmp_path: Path, name: str, *, lose_at: int | None = None, steps: int = STEPS, resume: bool = False, **config: Any
) -> Any:
    log = tmp_path / f"{name}.traces.jsonl"
    injector = FaultInjector()
    if lose_at is not None:
        injector.lose_slice(lose_at, slice_index=1, slice_size=2)
    values: dict[str, Any] = {"run_dir": str(tmp_path / name), "scale_up_poll_s": None}
    runtime = ElasticRuntime(keyed_job(trace_log=log), config=RuntimeConfig(**(values | config)), mesh_policy=POLICY)
    result = injector.attach(runtime).run(steps, resume=resume)
    traces = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return result, traces


def keys_equal(a: Any, b: Any) -> bool:
    return bool(np.array_equal(jax.random.key_data(a), jax.random.key_data(b)))


def test_keys_survive_a_lost_slice_and_every_trace_sees_its_own_mesh(tmp_path: Path) -> None:
    reference, _ = run(tmp_path, "reference", precompile=False)
    result, traces = run(tmp_path, "lost", lose_at=6, disk_every=4)
    assert jax.dtypes.issubdtype(result.state["key"].dtype, jax.dtypes.prng_key)  # the user's view: a key
    assert keys_equal(result.state["key"], reference.state["key"])  # no split lost or repeated
    match = compare_states(result.state["params"], reference.state["params"], bitwise=False, rtol=1e-5)
    assert match["match"], match
    assert result.loss is not None  # read through the nested loss_key
    # The full mesh, the degraded ones compiled in the background, and the one recovered onto: all traced
    # under their own mesh.
    shapes = {tuple(sorted(t["shape"].items())) for t in traces}
    assert len(shapes) >= 2 and all(t["own_mesh"] for t in traces), traces


def test_keys_go_through_the_disk_tier_and_a_resume(tmp_path: Path) -> None:
    reference, _ = run(tmp_path, "reference", precompile=False)
    first, _ = run(tmp_path, "resumed", steps=8, disk_every=4, precompile=False)
    assert keys_equal(first.state["key"], run(tmp_path, "eight", steps=8, precompile=False)[0].state["key"])
    resumed, _ = run(tmp_path, "resumed", resume=True, disk_every=4, precompile=False)
    assert keys_equal(resumed.state["key"], reference.state["key"])
    assert compare_states(resumed.state["params"], reference.state["params"], bitwise=True)["match"]


def test_key_leaves_are_found_without_running_init() -> None:
    calls: list[int] = []

    def init() -> dict[str, Any]:
        calls.append(1)
        return {"k": jax.random.key(0), "w": np.zeros(3, np.float32)}

    keys = KeyLeaves.of(init)
    assert keys and [impl is not None for impl in keys.impls] == [True, False]
    data = keys.to_data(init())
    assert data["k"].dtype == np.uint32 and keys_equal(keys.to_keys(data)["k"], jax.random.key(0))
    job = TrainJob(init=lambda: {"w": np.zeros(3, np.float32)}, step=lambda s, b: (s, {}), data=None)  # type: ignore[arg-type]
    assert with_key_data(job)[0] is job  # no keys: the job as it is


def test_a_job_needs_a_step_and_a_process_mesh_needs_its_replica_axis() -> None:
    with pytest.raises(ConfigError, match="needs a step"):
        TrainJob(init=dict, step=None, data=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="replica axis"):
        ProcessMesh({"fsdp": -1}, replica_axis="data")
    with pytest.raises(ConfigError, match="more than one"):
        ProcessMesh({"data": -1, "fsdp": -1, "tensor": -1})


def test_a_process_mesh_lays_each_slice_over_its_own_axes() -> None:
    devices = jax.devices()[:8]
    mesh = ProcessMesh({"data": -1, "fsdp": -1, "tensor": 2}).build(devices, 2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert [d.id for d in mesh.devices[1].flat] == [d.id for d in devices[4:]]  # a slice's devices together
    moved = ProcessMesh({"stage": 1, "data": -1, "fsdp": -1}).build(devices, 4)
    assert dict(moved.shape) == {"stage": 1, "data": 4, "fsdp": 2}
    with pytest.raises(Exception, match="do not fill"):
        ProcessMesh({"data": -1, "tensor": 3}).build(devices, 2)
