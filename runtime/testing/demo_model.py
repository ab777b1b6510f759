"""The demo's model and data: a two-layer MLP learning a fixed teacher network, with momentum SGD.

Small enough for 8 virtual CPU devices on a laptop, real enough to show re-meshing: the batch is split over
the ``data`` axis and the hidden layer over the ``model`` axis, so a lost slice really moves shards.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from elastic_runtime.core.job import TrainJob

State = dict[str, dict[str, Any]]


class TeacherData:
    """Deterministic regression batches: position ``i`` always yields the same inputs and targets."""

    def __init__(self, *, global_batch: int, features: int = 64, seed: int = 0) -> None:
        self.global_batch = global_batch
        self.features = features
        self.seed = seed
        teacher = np.random.default_rng([seed, 2**31 - 1])
        self._w = teacher.standard_normal((features, 32)).astype(np.float32) / np.sqrt(features)
        self._v = teacher.standard_normal((32, 1)).astype(np.float32) / np.sqrt(32)

    def batch(self, position: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, position])
        x = rng.standard_normal((self.global_batch, self.features)).astype(np.float32)
        y = np.tanh(x @ self._w) @ self._v
        return {"x": x, "y": y.astype(np.float32)}


def init_state(features: int = 64, hidden: int = 512, seed: int = 0) -> State:
    rng = np.random.default_rng(seed)
    params = {
        "w1": (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32),
        "b1": np.zeros((hidden,), np.float32),
        "w2": (rng.standard_normal((hidden, 1)) / np.sqrt(hidden)).astype(np.float32),
    }
    return {"params": params, "momentum": {k: np.zeros_like(v) for k, v in params.items()}}


def _loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    # GELU, not ReLU: on a shrunk mesh gradients are summed in another order, and a ReLU unit sitting at its
    # kink can flip on a 1e-7 difference and move the result by 1e-3; a smooth activation keeps it near 1e-7.
    hidden = jax.nn.gelu(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def train_step(
    state: State, batch: dict[str, jax.Array], lr: float = 0.002, beta: float = 0.9
) -> tuple[State, dict[str, jax.Array]]:
    loss, grads = jax.value_and_grad(_loss)(state["params"], batch)
    momentum = jax.tree.map(lambda m, g: beta * m + g, state["momentum"], grads)
    params = jax.tree.map(lambda p, m: p - lr * m, state["params"], momentum)
    return {"params": params, "momentum": momentum}, {"loss": loss}


# The hidden dimension is split over "model"; everything else is replicated. Momentum mirrors params.
_PARAM_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
STATE_SPECS = {"params": _PARAM_SPECS, "momentum": _PARAM_SPECS}


def demo_job(*, global_batch: int = 96, features: int = 256, hidden: int = 2048, seed: int = 0) -> TrainJob:
    """The demo's job: batch split over ``data``, hidden layer over ``model``."""
    return TrainJob(
        init=lambda: init_state(features, hidden, seed),
        step=train_step,
        data=TeacherData(global_batch=global_batch, features=features, seed=seed),
        state_specs=STATE_SPECS,
        batch_spec=P("data"),
    )
