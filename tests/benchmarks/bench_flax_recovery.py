"""The flax example's recovery (examples/flax_lm.py: a 2-layer decoder LM in flax nnx with optax adamw, 91
state arrays) against a process restart that restores it with plain Orbax.

All on 8 CPU devices, mesh data=4 x model=2, each in-process run with an empty compilation cache at start
(its own run folder, so its own empty ``xla-cache``):

- one compile: the programs of one degraded mesh (6 devices) compiled alone, before anything else runs: the
  unit of the goal for ``LikelyMeshesReady`` (likely meshes x one compile / the machine's cores);
- after compiles: a random slice (``--seed``) is lost at a random step 1-30 steps after ``LikelyMeshesReady``
  (every mesh one lost slice leads to is compiled); the figures are the event log's ``recovery_s`` and
  ``compile_wait_s``, the number of XLA compiles that ran during the recovery (from JAX's own monitoring
  events: none should), and ``LikelyMeshesReady``'s ``seconds`` from the start;
- early: a random slice lost at step 3, while the background compiles run: the recovery compiles its own
  mesh at once (never behind another mesh's compile); ``compile_wait_s`` says how long, and the number of
  ``MeshReady`` events before its ``RecoveryCompleted`` how many other meshes were done first;
- with ``--compare``, each in-process run again with every mesh compiled on its own (as before
  ``runtime/core/same_shape.py``, which on CPU compiles the first mesh of a shape and loads it onto the others),
  alternating, each variant's figures under its own keys (``own_compiles``);
- restart: a new Python process starts, JAX initialises its devices, the model and optimizer are built, the
  state is restored with plain Orbax (``StandardCheckpointer``) from a checkpoint of the same state on local
  disk onto the 6-device mesh, the step is compiled and run once; from spawning the process to that step's
  result. Failure detection and rescheduling, which a real restart also pays, are left out in its favour.

    .venv/bin/python tests/benchmarks/bench_flax_recovery.py [--repeats 5] [--seed 0] [--no-restart] [--compare]
        [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from elastic_runtime import ElasticRuntime, MeshPolicy, RecoveryCompleted, RuntimeConfig, read_events  # noqa: E402
from elastic_runtime.core.compiler import StepCompiler  # noqa: E402
from elastic_runtime.core.events import LikelyMeshesReady, MeshReady  # noqa: E402
from elastic_runtime.core.initial import abstract_state  # noqa: E402
from elastic_runtime.core.same_shape import SameShape  # noqa: E402
from elastic_runtime.testing import FaultInjector  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flax_lm.py"
sys.path.insert(0, str(EXAMPLE.parent))
import flax_lm  # noqa: E402  (examples/flax_lm.py)
from bench_recovery import restart, write_checkpoint  # noqa: E402  (the same checkpoint and restart)

GLOBAL_BATCH = 48
POLICY = MeshPolicy({"data": 4, "model": 2}, global_batch=GLOBAL_BATCH, slice_size=2)
STEPS = 600  # enough for every likely mesh to be compiled and 30 steps more, on a loaded machine too

RESTART = f"""
import sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
sys.path.insert(0, {str(EXAMPLE.parent)!r})
import flax_lm
from elastic_runtime.core.compiler import shardings_for
from elastic_runtime.core.mesh import MeshPolicy
job = flax_lm.make_job(flax_lm.ModelConfig(), global_batch={GLOBAL_BATCH})
mesh = MeshPolicy({{"data": 3, "model": 2}}, global_batch={GLOBAL_BATCH}, slice_size=2).fit(jax.devices()[:6])
state_sharding = shardings_for(job.state_specs, mesh)
abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), job.init(), state_sharding)
state = ocp.StandardCheckpointer().restore(sys.argv[1], abstract)
step = jax.jit(job.step, in_shardings=(state_sharding, shardings_for(job.batch_spec, mesh)),
               out_shardings=(state_sharding, NamedSharding(mesh, P())))
state, metrics = step(state, jax.device_put(job.data.batch(99), shardings_for(job.batch_spec, mesh)))
print("loss", float(metrics["loss"]), flush=True)
"""


def in_process(job: Any, run_dir: str, *, late: bool, rng: random.Random) -> dict[str, float]:
    """One run with one slice lost, chosen by ``rng``: ``late``, at a random step 1-30 steps after every likely
    mesh is compiled (``LikelyMeshesReady``); else at step 3, while the background compiles run."""
    injector = FaultInjector()
    runtime = injector.attach(ElasticRuntime(job, config=RuntimeConfig(run_dir=run_dir), mesh_policy=POLICY))
    lost_slice = rng.randrange(4)
    lost = [2 * lost_slice, 2 * lost_slice + 1]
    delay = rng.randint(1, 30)
    faulted: list[float] = []
    ready_at: list[int] = []  # the step at which LikelyMeshesReady came
    compiles: list[float] = []  # when each XLA compile finished

    @runtime.on(LikelyMeshesReady)
    async def ready(event: LikelyMeshesReady, ctx: Any) -> None:
        ready_at.append(event.step)

    def fault(step: int) -> None:
        due = bool(ready_at) and step >= ready_at[0] + delay if late else step == 3
        if not faulted and due:
            injector.kill_now(lost)
            faulted.append(time.monotonic())

    def compiled(event: str, seconds: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(time.monotonic())

    runtime.at_step_boundary(fault)
    jax.monitoring.register_event_duration_secs_listener(compiled)
    try:
        result = runtime.run(STEPS if late else 60)
    finally:
        jax.monitoring.unregister_event_duration_listener(compiled)
    assert result.events_path is not None and faulted, "no fault: LikelyMeshesReady never came within the run"
    events = read_events(result.events_path)
    [recovery] = [e for e in events if isinstance(e, RecoveryCompleted)]
    likely = [e for e in events if isinstance(e, LikelyMeshesReady)]
    assert recovery.lost_steps == 0
    window = (faulted[0], faulted[0] + recovery.recovery_s)
    run = {
        "slice": lost_slice,
        "failed_step": recovery.failed_step,
        "recovery_s": recovery.recovery_s,
        "compile_wait_s": recovery.compile_wait_s,
        "compiles_during_recovery": sum(window[0] <= t <= window[1] for t in compiles),
        # From the first mesh taken into use to every likely mesh compiled (the first LikelyMeshesReady).
        "likely_ready_s": likely[0].seconds if likely else float("nan"),
        "likely_meshes": likely[0].meshes if likely else 0,
    }
    if not late:  # did the recovery finish before the meshes it did not need were all compiled?
        before = [e for e in events if isinstance(e, MeshReady) and e.mono_time <= recovery.mono_time]
        run["meshes_ready_before_recovery"] = len(before)
    return run


def one_compile(job: Any) -> float:
    """One degraded mesh's programs (the step with its fused snapshot copy, as the runtime compiles them)
    compiled alone, nothing else running: the unit of the goal. Run first, before any cache holds it."""
    mesh = POLICY.fit([d for d in jax.devices() if d.id not in (6, 7)])
    compiler = StepCompiler(job, abstract_state(job), job.data.batch(0), host_copy=True)
    started = time.monotonic()
    compiler.get(mesh)
    return time.monotonic() - started


@contextlib.contextmanager
def each_mesh_compiled(own: bool) -> Iterator[None]:
    """With ``own``, every mesh's programs compiled on their own, none loaded from another mesh's."""
    shared = SameShape.compiled
    if own:
        SameShape.compiled = lambda self, name, mesh, lowered: lowered.compile()  # type: ignore[method-assign]
    try:
        yield
    finally:
        SameShape.compiled = shared  # type: ignore[method-assign]
        jax.clear_caches()  # nothing compiled in one run serves the next from memory


def summary(late: list[dict[str, float]], early: list[dict[str, float]], alone: float) -> dict[str, Any]:
    goal = late[0]["likely_meshes"] * alone / (os.cpu_count() or 1)  # likely meshes x one mesh's compile / cores
    return {
        "after_compiles_recovery_s_median": median(late, "recovery_s"),
        "after_compiles_recovery_s_max": round(max(run["recovery_s"] for run in late), 4),
        "after_compiles_compile_wait_s_max": round(max(run["compile_wait_s"] for run in late), 4),
        "after_compiles_compiles_during_recovery_max": max(int(run["compiles_during_recovery"]) for run in late),
        "lost_slices": [int(run["slice"]) for run in late],
        "failed_steps": [int(run["failed_step"]) for run in late],
        "likely_ready_s": [round(run["likely_ready_s"], 2) for run in late],
        "likely_ready_s_median": median(late, "likely_ready_s"),
        "likely_ready_goal_s": round(goal, 3),
        "likely_ready_over_goal": round(median(late, "likely_ready_s") / goal, 2),
        "early_recovery_s_median": median(early, "recovery_s"),
        "early_compile_wait_s_median": median(early, "compile_wait_s"),
        "early_meshes_ready_before_recovery": [int(run["meshes_ready_before_recovery"]) for run in early],
        "early_lost_slices": [int(run["slice"]) for run in early],
    }


def median(runs: list[dict[str, float]], key: str) -> float:
    return round(float(np.median([run[key] for run in runs])), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="chooses each run's lost slice and step")
    parser.add_argument("--no-restart", action="store_true", help="skip the Orbax restart baseline")
    parser.add_argument("--compare", action="store_true", help="each run again with every mesh compiled on its own")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    job = flax_lm.make_job(flax_lm.ModelConfig(), global_batch=GLOBAL_BATCH)
    rng = random.Random(args.seed)
    alone = one_compile(job)
    variants = [False, True] if args.compare else [False]  # own compiles: False is the runtime as it is
    late: dict[bool, list[dict[str, float]]] = {own: [] for own in variants}
    early: dict[bool, list[dict[str, float]]] = {own: [] for own in variants}
    restarts: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "ckpt"
        write_checkpoint(checkpoint, job)
        for i in range(args.repeats):
            draw = rng.getstate()
            for own in variants:
                rng.setstate(draw)  # the same slices and steps for both variants
                with each_mesh_compiled(own):
                    late[own].append(in_process(job, f"{tmp}/late-{i}-{own}", late=True, rng=rng))
                with each_mesh_compiled(own):
                    early[own].append(in_process(job, f"{tmp}/early-{i}-{own}", late=False, rng=rng))
                print(
                    json.dumps({"own_compiles": own, "late": late[own][-1], "early": early[own][-1]}), file=sys.stderr
                )
            if not args.no_restart:
                restarts.append(restart(checkpoint, RESTART))
    result: dict[str, Any] = {"one_mesh_compile_s": round(alone, 3), **summary(late[False], early[False], alone)}
    if args.compare:
        result["own_compiles"] = summary(late[True], early[True], alone)
    result.update(repeats=args.repeats, load_average=round(os.getloadavg()[0], 2))
    if restarts:
        result["restart_with_orbax_s_median"] = round(float(np.median(restarts)), 4)
        result["speedup_after_compiles_median"] = round(
            float(np.median(restarts)) / median(late[False], "recovery_s"), 1
        )
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
