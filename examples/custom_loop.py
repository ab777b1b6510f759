"""Embed the runtime in your own training code: your model, your data, your step; the runtime makes it elastic.

Run it:  .venv/bin/python examples/custom_loop.py
It trains a linear model data-parallel on 8 virtual CPU devices, loses device 5 at step 30 (a fault
injected the way a real runtime would report it) and finishes on a spare device, bitwise identical to a run
without the fault.
"""

from __future__ import annotations

import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from elastic_runtime import (  # noqa: E402
    ElasticRuntime,
    MeshPolicy,
    RecoveryCompleted,
    RuntimeConfig,
    RuntimeContext,
    TrainJob,
)
from elastic_runtime.testing import FaultInjector  # noqa: E402


class Regression:
    """Your data source: ``batch(position)`` must always return the same batch for the same position."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch
        self.true_w = np.linspace(-1, 1, 16, dtype=np.float32)

    def batch(self, position: int) -> dict[str, np.ndarray]:
        x = np.random.default_rng(position).standard_normal((self.global_batch, 16)).astype(np.float32)
        return {"x": x, "y": x @ self.true_w}


def init() -> dict[str, Any]:
    return {"w": np.zeros(16, np.float32), "step_size": np.float32(0.1)}


def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    def loss_fn(w: jax.Array) -> jax.Array:
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - state["step_size"] * grad, "step_size": state["step_size"]}, {"loss": loss}


def main() -> None:
    job = TrainJob(init=init, step=step, data=Regression(global_batch=64), state_specs=P(), batch_spec=P("data"))
    # Four devices train; the other four are spares that replace a lost one without changing the mesh.
    policy = MeshPolicy({"data": 4}, global_batch=64)
    injector = FaultInjector().lose_devices(at_step=30, devices=[2])
    runtime = injector.attach(
        ElasticRuntime(
            job, config=RuntimeConfig(run_dir=time.strftime("runs/custom-loop-%Y%m%d-%H%M%S")), mesh_policy=policy
        )
    )

    @runtime.on(RecoveryCompleted)
    async def report(event: RecoveryCompleted, ctx: RuntimeContext) -> None:
        print(f"recovered from {event.cause} in {event.recovery_s:.3f} s, lost {event.lost_steps} step(s)")

    result = runtime.run(steps=60)
    reference = ElasticRuntime(job, mesh_policy=policy).run(steps=60)
    same = np.array_equal(result.state["w"], reference.state["w"])
    print(f"loss {result.loss:.6f} after {result.step} steps; identical to a fault-free run: {same}")


if __name__ == "__main__":
    main()
