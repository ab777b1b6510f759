"""A training script with its own handlers, written as ``examples/custom_handler.py`` writes them, for
``test_handlers_everywhere.py``; also a controller-side handler for ``launch --handlers``. Not collected.

    python tests/multiprocess/handlers_train.py --steps 30 --out DIR [--scale 0.5] [--abort] [--checkpoint-on TYPE]

``--scale``: on StateRestored, scale every float leaf of the state (``ctx.transform_state``); ``--abort``: on
the first GroupFormed, abort the run and (another handler) ask for a re-mesh, which this mode cannot do;
``--checkpoint-on``: on the first event of that type, ask for a durable checkpoint (``ctx.request_checkpoint``).

Every process appends what its handlers saw to ``DIR/handlers-PID.jsonl``: the event, ``ctx.lead``, the
process id and the step boundary the handler ran at; and what its ``run()`` returned to ``DIR/after-PID.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import elastic_runtime as runtime_api
from elastic_runtime import ElasticRuntime, Event, GroupFormed, MeshPolicy, RecoveryCompleted, StateRestored, WorkerLost
from elastic_runtime.cli.demo_multiprocess import FEATURES, GLOBAL_BATCH, HIDDEN
from elastic_runtime.testing.demo_model import demo_job

# Where the controller-side handler writes (set by the test in the controller's environment).
ENV_CONTROLLER_OUT = "HANDLERS_TEST_CONTROLLER_OUT"


def record(out: Path, event: Any, ctx: Any) -> None:
    line = {
        "event": type(event).__name__,
        "lead": ctx.lead,
        "process": ctx.process_id,
        "generation": ctx.generation,
        "step": event.step,
        "at": ctx.step,
    }
    with (out / f"handlers-{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scale", type=float, default=0.0, help="on StateRestored: scale every float leaf")
    parser.add_argument("--abort", action="store_true", help="on GroupFormed: abort the run (and try a remesh)")
    parser.add_argument("--checkpoint-on", default="", help="an event type: ask for a checkpoint on it")
    args = parser.parse_args()
    job = demo_job(global_batch=GLOBAL_BATCH, features=FEATURES, hidden=HIDDEN)
    runtime = ElasticRuntime(job, mesh_policy=MeshPolicy({"data": 1, "model": 1}))

    @runtime.on(WorkerLost)
    async def lost(event: WorkerLost, ctx: Any) -> None:
        record(args.out, event, ctx)

    @runtime.on(GroupFormed)
    async def formed(event: GroupFormed, ctx: Any) -> None:
        record(args.out, event, ctx)
        if args.abort:
            ctx.abort(f"generation {event.generation} formed: giving up on purpose")

    @runtime.on(GroupFormed, priority=-1)
    async def try_remesh(event: GroupFormed, ctx: Any) -> None:
        if args.abort:
            ctx.remesh(None, reason="not possible under launch")

    @runtime.on(StateRestored)
    async def restored(event: StateRestored, ctx: Any) -> None:
        record(args.out, event, ctx)
        if args.scale:

            def scale(state: Any) -> Any:
                floats = lambda x: x * args.scale if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
                return jax.tree.map(floats, state)

            ctx.transform_state(scale, reason=f"scale by {args.scale} after a restore")

    async def checkpoint(event: Event, ctx: Any) -> None:
        await ctx.request_checkpoint(reason=f"on {args.checkpoint_on}")

    if args.checkpoint_on:
        runtime.subscribe(getattr(runtime_api, args.checkpoint_on), checkpoint, priority=-2)

    @runtime.on(RecoveryCompleted)
    async def recovered(event: RecoveryCompleted, ctx: Any) -> None:
        record(args.out, event, ctx)

    result = runtime.run(args.steps)  # the final state not asked for: it stays in the processes' shards
    with (args.out / f"after-{os.getpid()}.json").open("w") as f:
        json.dump({"lead": result.lead, "step": result.step, "has_state": result.state is not None}, f)


async def count_on_controller(event: GroupFormed | StateRestored, ctx: Any) -> None:
    """A controller-side handler (``launch --handlers handlers_train:count_on_controller``): once per event."""
    with Path(os.environ[ENV_CONTROLLER_OUT]).open("a") as f:
        f.write(json.dumps({"event": type(event).__name__, "step": event.step}) + "\n")


if __name__ == "__main__":
    main()
