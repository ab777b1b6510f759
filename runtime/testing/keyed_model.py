"""A job shaped like a real model's (MaxText's): typed PRNG keys in the state, its own mesh axes (``data``,
``fsdp``, ``tensor``), a step built per concrete mesh that constrains with ``NamedSharding(mesh, ...)``, and
nested metrics. The demo's MLP learning its teacher, with a little key-driven noise in every update, so that
the key really is state: a run that lost or repeated a key split would not end bitwise equal.

Each trace of the step records, to ``trace_log`` when given, whether it ran under its own mesh
(``jax.sharding.get_abstract_mesh()`` is the concrete mesh's), for the tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elastic_runtime.core.job import StepFn, TrainJob
from elastic_runtime.core.mesh import ProcessMesh
from elastic_runtime.testing.demo_model import TeacherData, init_state

AXES = {"data": -1, "fsdp": -1, "tensor": 1}
_PARAMS = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}
STATE_SPECS = {"params": _PARAMS, "momentum": _PARAMS, "key": P()}


def keyed_job(
    *, global_batch: int = 96, features: int = 64, hidden: int = 256, trace_log: Path | None = None
) -> TrainJob:
    """The job; ``trace_log``: a JSON-lines file each trace of the step appends to."""

    def init() -> dict[str, Any]:
        return {**init_state(features, hidden), "key": jax.random.key(7)}

    def step_for_mesh(mesh: Mesh) -> StepFn:
        rows = NamedSharding(mesh, P(("data", "fsdp")))  # the concrete mesh, as a MaxText module keeps it

        def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, Any]]:
            if trace_log is not None:
                record = {"pid": os.getpid(), "own_mesh": jax.sharding.get_abstract_mesh() == mesh.abstract_mesh}
                with trace_log.open("a") as f:
                    f.write(json.dumps(record | {"shape": dict(mesh.shape)}) + "\n")
            batch = {k: jax.lax.with_sharding_constraint(v, rows) for k, v in batch.items()}
            key, noise_key = jax.random.split(state["key"])

            def loss_fn(params: dict[str, jax.Array]) -> jax.Array:
                hidden = jax.nn.gelu(batch["x"] @ params["w1"] + params["b1"])
                return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(state["params"])
            noise = jax.random.normal(noise_key, state["params"]["b1"].shape) * 1e-4
            grads = {**grads, "b1": grads["b1"] + noise}
            momentum = jax.tree.map(lambda m, g: 0.9 * m + g, state["momentum"], grads)
            params = jax.tree.map(lambda p, m: p - 0.002 * m, state["params"], momentum)
            return {"params": params, "momentum": momentum, "key": key}, {"scalar": {"learning/loss": loss}}

        return step

    return TrainJob(
        init=init,
        step=None,
        step_for_mesh=step_for_mesh,
        data=TeacherData(global_batch=global_batch, features=features),
        state_specs=STATE_SPECS,
        batch_spec=P(("data", "fsdp")),
        loss_key=("scalar", "learning/loss"),
        process_mesh=ProcessMesh(AXES),
    )
