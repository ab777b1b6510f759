"""The flax example's recovery (examples/flax_lm.py: a 2-layer decoder LM in flax nnx with optax adamw, 91
state arrays) against a process restart that restores it with plain Orbax.

All on 8 CPU devices, mesh data=4 x model=2, each in-process run with an empty compilation cache at start
(its own run folder, so its own empty ``xla-cache``):

- after compiles: slice 3 is lost at the first step after step 20 at which the background compile of the
  6-device mesh is done (a fault after start-up); the figures are the event log's ``recovery_s`` and
  ``compile_wait_s``, and the number of XLA compiles that ran during the recovery (from JAX's own monitoring
  events: none should);
- early: the same fault at step 3, before the background compiles finish: the recovery waits for the compile
  of its mesh, and ``compile_wait_s`` says how long;
- restart: a new Python process starts, JAX initialises its devices, the model and optimizer are built, the
  state is restored with plain Orbax (``StandardCheckpointer``) from a checkpoint of the same state on local
  disk onto the 6-device mesh, the step is compiled and run once; from spawning the process to that step's
  result. Failure detection and rescheduling, which a real restart also pays, are left out in its favour.

    .venv/bin/python tests/benchmarks/bench_flax_recovery.py [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from runtime import ElasticRuntime, MeshPolicy, RecoveryCompleted, RuntimeConfig, read_events  # noqa: E402
from runtime.testing import FaultInjector  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "flax_lm.py"
sys.path.insert(0, str(EXAMPLE.parent))
import flax_lm  # noqa: E402  (examples/flax_lm.py)
from bench_recovery import restart, write_checkpoint  # noqa: E402  (the same checkpoint and restart)

GLOBAL_BATCH = 48
POLICY = MeshPolicy({"data": 4, "model": 2}, global_batch=GLOBAL_BATCH, slice_size=2)
FAULT_AFTER = 20

RESTART = f"""
import sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
sys.path.insert(0, {str(EXAMPLE.parent)!r})
import flax_lm
from runtime.core.compiler import shardings_for
from runtime.core.mesh import MeshPolicy
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


def in_process(job: Any, run_dir: str, *, after_compiles: bool) -> dict[str, float]:
    injector = FaultInjector()
    runtime = injector.attach(ElasticRuntime(job, config=RuntimeConfig(run_dir=run_dir), mesh_policy=POLICY))
    after_fault = POLICY.fit([d for d in jax.devices() if d.id not in (6, 7)])
    faulted: list[float] = []
    compiles: list[float] = []  # when each XLA compile finished

    def fault(step: int) -> None:
        compiler = runtime.executor.compiler
        ready = compiler is not None and compiler.is_ready(after_fault)
        due = step >= FAULT_AFTER and ready if after_compiles else step == 3
        if not faulted and due:
            injector.kill_now([6, 7])
            faulted.append(time.monotonic())

    def compiled(event: str, seconds: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(time.monotonic())

    runtime.at_step_boundary(fault)
    jax.monitoring.register_event_duration_secs_listener(compiled)
    try:
        result = runtime.run(300)
    finally:
        jax.monitoring.unregister_event_duration_listener(compiled)
    assert result.events_path is not None and faulted, "the 6-device mesh was never compiled in the background"
    [recovery] = [e for e in read_events(result.events_path) if isinstance(e, RecoveryCompleted)]
    assert recovery.lost_steps == 0
    window = (faulted[0], faulted[0] + recovery.recovery_s)
    return {
        "recovery_s": recovery.recovery_s,
        "compile_wait_s": recovery.compile_wait_s,
        "compiles_during_recovery": sum(window[0] <= t <= window[1] for t in compiles),
    }


def median(runs: list[dict[str, float]], key: str) -> float:
    return round(float(np.median([run[key] for run in runs])), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    job = flax_lm.make_job(flax_lm.ModelConfig(), global_batch=GLOBAL_BATCH)
    late: list[dict[str, float]] = []
    early: list[dict[str, float]] = []
    restarts: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "ckpt"
        write_checkpoint(checkpoint, job)
        for i in range(args.repeats):
            late.append(in_process(job, f"{tmp}/late-{i}", after_compiles=True))
            early.append(in_process(job, f"{tmp}/early-{i}", after_compiles=False))
            restarts.append(restart(checkpoint, RESTART))
    result = {
        "after_compiles_recovery_s_median": median(late, "recovery_s"),
        "after_compiles_recovery_s_max": round(max(run["recovery_s"] for run in late), 4),
        "after_compiles_compile_wait_s_max": round(max(run["compile_wait_s"] for run in late), 4),
        "after_compiles_compiles_during_recovery_max": max(int(run["compiles_during_recovery"]) for run in late),
        "early_recovery_s_median": median(early, "recovery_s"),
        "early_compile_wait_s_median": median(early, "compile_wait_s"),
        "restart_with_orbax_s_median": round(float(np.median(restarts)), 4),
        "speedup_after_compiles_median": round(float(np.median(restarts)) / median(late, "recovery_s"), 1),
        "repeats": args.repeats,
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
