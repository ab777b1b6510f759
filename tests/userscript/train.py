"""A user's training script, written from the docs: a plain JAX + optax classifier with its own handlers
(``handlers.py`` beside it), run the same way embedded and under ``elastic-runtime launch``. Not collected by
pytest; ``tests/test_one_runtime.py`` runs it.

    python tests/userscript/train.py --steps 40 --lose-slice-at 12 --repair-at 24   # embedded, 8 CPU devices
    elastic-runtime launch --nprocs 3 --min-nprocs 2 -- python tests/userscript/train.py --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

import anyio
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import handlers  # the user's own, beside this script
from elastic_runtime import (
    ElasticRuntime,
    HandlerContext,
    MeshPolicy,
    RuntimeConfig,
    ScaleUpAvailable,
    TrainJob,
)

FEATURES, CLASSES, HIDDEN, GLOBAL_BATCH = 16, 4, 32, 48
momentum = optax.trace(decay=0.9)


class Blobs:
    """Gaussian blobs, one per class: batch ``position`` is the same every time it is read; ``delay_s`` a slow
    reader's time per batch."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def batch(self, position: int) -> dict[str, np.ndarray]:
        time.sleep(self.delay_s)
        rng = np.random.default_rng(position)
        labels = rng.integers(0, CLASSES, GLOBAL_BATCH)
        centres = np.random.default_rng(0).standard_normal((CLASSES, FEATURES)) * 2
        x = centres[labels] + rng.standard_normal((GLOBAL_BATCH, FEATURES))
        return {"x": x.astype(np.float32), "y": labels.astype(np.int32)}


def init() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    params = {
        "w1": (rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32),
        "w2": (rng.standard_normal((HIDDEN, CLASSES)) / np.sqrt(HIDDEN)).astype(np.float32),
    }
    return {"params": params, "opt": momentum.init(params), "lr": np.float32(0.05)}


def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    def loss_fn(params: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        logits = jax.nn.relu(batch["x"] @ params["w1"]) @ params["w2"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == batch["y"])

    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt = momentum.update(grads, state["opt"])
    params = jax.tree.map(lambda p, u: p - state["lr"] * u, state["params"], updates)
    return {"params": params, "opt": opt, "lr": state["lr"]}, {"loss": loss, "accuracy": accuracy, "lr": state["lr"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--lose-slice-at", type=int, default=0, help="embedded: slice 3 of 4 lost at this step")
    parser.add_argument("--repair-at", type=int, default=0, help="embedded: the slice back at this step")
    parser.add_argument("--slow-replacement-s", type=float, default=0.0, help="launch: a replacement starts late")
    parser.add_argument("--batch-delay-s", type=float, default=0.0, help="a slow data source: seconds a batch")
    parser.add_argument("--first-workers", type=int, default=3, help="launch: workers 0 to N-1 are not replacements")
    args = parser.parse_args()
    if args.slow_replacement_s and int(os.environ.get("ELASTIC_WORKER_ID", "0")) >= args.first_workers:
        time.sleep(args.slow_replacement_s)  # a cold node: the first workers are not replacements
    job = TrainJob(init=init, step=step, data=Blobs(args.batch_delay_s), state_specs=P(), batch_spec=P("data"))
    config = RuntimeConfig(run_dir=args.run_dir, progress_every_s=1.0, scale_up_poll_s=0.2)
    runtime = ElasticRuntime(job, config=config, mesh_policy=MeshPolicy({"data": 4, "model": 2}, slice_size=2))
    handlers.subscribe(runtime)
    if args.lose_slice_at:
        from elastic_runtime.testing.faults import FaultInjector

        injector = FaultInjector().lose_slice(at_step=args.lose_slice_at, slice_index=3, slice_size=2)
        injector.repair(at_step=args.repair_at, devices=(6, 7)).attach(runtime)
        offered = threading.Event()

        @runtime.on(ScaleUpAvailable, priority=-10)  # after the built-in scale-up handler asked for the mesh
        async def back(event: ScaleUpAvailable, ctx: HandlerContext) -> None:
            offered.set()

        # The test's way to see the repaired slice taken back before the run ends, however fast or loaded the
        # machine: from 2 steps after the repair, each step waits (up to a minute) until the scale-up was asked
        # for. An async hook waits in the event loop, where the scale-up watcher and its handler run.
        @runtime.at_step_boundary
        async def hold(next_step: int) -> None:
            with anyio.move_on_after(60.0):
                while next_step > args.repair_at + 2 and not offered.is_set():
                    await anyio.sleep(0.05)

    result = runtime.run(args.steps, gather=True)  # the lead reports the final learning rate
    # Code after run(), in every process: the lead reports.
    has_state = result.state is not None
    handlers.record("after_run", mode=result.mode, lead=result.lead, step=result.step, has_state=has_state)
    if result.lead:
        print(json.dumps({"step": result.step, "loss": result.loss, "lr": float(result.state["lr"])}), flush=True)


if __name__ == "__main__":
    main()
