"""In-process recovery against a full process restart that restores from an Orbax checkpoint.

Both recover the demo model (8 CPU devices, mesh data=4 x model=2) from the loss of a slice:

- in-process: the runtime loses slice 3 (a JaxRuntimeError DATA_LOSS raised by the step) at the first step
  after step 100 at which the background compile of the 6-device mesh is done (the steady state: a fault
  sooner waits for that compile, about 0.3 s on this machine), re-meshes onto 6 devices, restores from the
  RAM snapshot and commits the step again; the figure is the event log's ``recovery_s`` (from catching the
  exception to the next committed step);
- restart: what a job without the runtime does: a new Python process starts, JAX initialises its devices,
  the state is restored with plain Orbax (``StandardCheckpointer``) from a checkpoint of the same state on
  local disk, the step is compiled and run once; the figure runs from spawning the process to that step's
  result. Failure detection and rescheduling, which a real restart also pays, are left out in its favour.

    .venv/bin/python tests/benchmarks/bench_recovery.py [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from elastic_runtime import ElasticRuntime, MeshPolicy, RecoveryCompleted, RuntimeConfig, TrainJob, read_events  # noqa: E402
from elastic_runtime.core.compiler import shardings_for  # noqa: E402
from elastic_runtime.testing import FaultInjector  # noqa: E402
from elastic_runtime.testing.demo_model import demo_job  # noqa: E402

POLICY = MeshPolicy({"data": 4, "model": 2}, global_batch=96, slice_size=2)
FAULT_AT = 100

RESTART = """
import sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
from elastic_runtime.core.compiler import shardings_for
from elastic_runtime.testing.demo_model import demo_job
from elastic_runtime.core.mesh import MeshPolicy
job = demo_job()
mesh = MeshPolicy({"data": 3, "model": 2}, global_batch=96, slice_size=2).fit(jax.devices()[:6])
state_sharding = shardings_for(job.state_specs, mesh)
abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), job.init(), state_sharding)
state = ocp.StandardCheckpointer().restore(sys.argv[1], abstract)
step = jax.jit(job.step, in_shardings=(state_sharding, shardings_for(job.batch_spec, mesh)),
               out_shardings=(state_sharding, NamedSharding(mesh, P())))
state, metrics = step(state, jax.device_put(job.data.batch(99), shardings_for(job.batch_spec, mesh)))
print("loss", float(metrics["loss"]), flush=True)
"""


def in_process(tmp: str) -> float:
    injector = FaultInjector()
    config = RuntimeConfig(run_dir=tmp, scale_up_poll_s=None)
    runtime = injector.attach(ElasticRuntime(demo_job(), config=config, mesh_policy=POLICY))
    after_fault = POLICY.fit([d for d in jax.devices() if d.id not in (6, 7)])
    faulted: list[int] = []

    def fault_once_compiled(step: int) -> None:
        compiler = runtime.executor.compiler
        if not faulted and step >= FAULT_AT and compiler is not None and compiler.is_ready(after_fault):
            injector.lose_slice(step, slice_index=3, slice_size=2)
            faulted.append(step)

    runtime.at_step_boundary(fault_once_compiled)
    result = runtime.run(FAULT_AT + 500)
    assert result.events_path is not None and faulted, "the 6-device mesh was never compiled in the background"
    [recovery] = [e for e in read_events(result.events_path) if isinstance(e, RecoveryCompleted)]
    assert recovery.lost_steps == 0
    return recovery.recovery_s


def write_checkpoint(path: Path, job: TrainJob | None = None) -> None:
    """``job``'s initial state (the demo's by default), sharded over every device, saved with plain Orbax."""
    job = job or demo_job()
    mesh = POLICY.fit(jax.devices())
    state = jax.device_put(job.init(), shardings_for(job.state_specs, mesh))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()


def restart(path: Path, script: str = RESTART) -> float:
    """Seconds from spawning ``python -c script path`` to its exit (the restart's first step done)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, capture_output=True, text=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    inproc, restarts = [], []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "ckpt"
        write_checkpoint(checkpoint)
        for i in range(args.repeats):
            inproc.append(in_process(f"{tmp}/run-{i}"))
            restarts.append(restart(checkpoint))
    result = {
        "in_process_recovery_s_median": round(float(np.median(inproc)), 4),
        "in_process_recovery_s_max": round(float(np.max(inproc)), 4),
        "restart_with_orbax_s_median": round(float(np.median(restarts)), 4),
        "restart_with_orbax_s_max": round(float(np.max(restarts)), 4),
        "speedup_median": round(float(np.median(restarts) / np.median(inproc)), 1),
        "repeats": args.repeats,
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
