"""Goodput under one fault per minute: the runtime against checkpoint-and-restart, same model, same schedule.

The jobs train the demo model (8 CPU devices, mesh data=4 x model=2) for the same number of steps, each in
its own process started by this script, and lose a slice every 60 s of wall time:

- runtime, defaults: ``ElasticRuntime`` with its defaults (RAM snapshot every step, disk tier), the slice lost
  through the fault injector and given back 20 s later; recovery happens in-process;
- runtime, Young-Daly snapshots: the same with ``snapshot_mtbf_s`` set to the fault interval, so that RAM
  snapshots come every sqrt(2 * copy cost * MTBF) of training instead of every step (on these CPU devices a
  snapshot is the state itself, no copy: no cost to plan by, and the job is the defaults' again);
- checkpoint-restart: a plain JAX loop (loading the next batch in the background, as the runtime does) with
  Orbax's async ``CheckpointManager`` saving every ``--save-every`` steps; at each fault the process is
  killed (SIGKILL) and started again, restoring the newest checkpoint (on the full mesh: the baseline gets
  its hardware back at once, in its favour);
- bare loop: the reference program itself (the same loop without a checkpoint manager) for all the steps,
  without faults: what a job with no fault, no checkpoint and no runtime scores by the same measure (its
  process start, its first step and the tail of its steps against their median are charged to it as to the
  others);
- pipelined loop: the bare loop with one step in flight (a step's loss read once the next one is queued
  behind it, as the runtime's executor does): what the same steps cost a plain loop at best here, no fault,
  no checkpoint, no runtime.

Goodput = steps x reference step time / wall time from the first process start to the end of the last one.
The reference step time is the median step of the bare jitted step on the full mesh, run for 600 steps in
its own process before and after each job (the mean of the two): the speed of this shared machine drifts
by more than the differences measured over the minutes a job takes. Every other cost (startup, compiles,
snapshot copies inside or outside the step, checkpoint saves, restarts, recoveries, re-done steps) is wall
time that produced no step. Summing each job's own step
durations instead would count a copy compiled into the runtime's step as productive.
``of_bare_loop`` is the bare loop's wall over a job's, in the same round: the same steps, the bare loop as 100%.

With ``--rounds N`` the five jobs run N times in turn and each figure is the median over the rounds.

Every process of the invocation shares JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``, every
compile cached however short), as a production job would set it: a restarted baseline loads its step instead
of compiling it again, and the runtime loads the meshes it compiles in the background. It starts empty, so the
first round of each job compiles cold; ``--no-compile-cache`` turns it off.

    .venv/bin/python tests/benchmarks/bench_goodput.py [--steps 12000] [--fault-every 60] [--rounds 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SLICE_SIZE = 2
REFERENCE_STEPS = 600  # each reference run: about 5 s of bare steps


def child_runtime(steps: int, run_dir: str, fault_every: float, repair_after: float, t0: float, mtbf: bool) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig, StepCompleted
    from elastic_runtime.testing import FaultInjector
    from elastic_runtime.testing.demo_model import demo_job
    from elastic_runtime.testing.faults import FaultSchedule

    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=96, slice_size=SLICE_SIZE)
    injector = FaultInjector()
    config = RuntimeConfig(run_dir=run_dir, snapshot_mtbf_s=fault_every if mtbf else None)
    runtime = injector.attach(ElasticRuntime(demo_job(), config=config, mesh_policy=policy))
    schedule = FaultSchedule.every(fault_every, repair_after_s=repair_after, slice_size=SLICE_SIZE, devices=8)
    runtime.at_step_boundary(schedule.hook(injector, clock=time.time, start=t0))  # the supervisor's clock

    @runtime.on(StepCompleted)
    async def report(event: StepCompleted, ctx: Any) -> None:
        print(f"step {event.step} {event.duration_s:.6f}", flush=True)

    runtime.run(steps)


def child_restart(steps: int, ckpt_dir: str, save_every: int, pipelined: bool = False) -> None:
    if pipelined and save_every:
        raise ValueError("a pipelined loop here saves no checkpoint (--save-every 0)")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from elastic_runtime.core.compiler import shardings_for
    from elastic_runtime.core.mesh import MeshPolicy
    from elastic_runtime.testing.demo_model import demo_job

    job = demo_job()
    mesh = MeshPolicy({"data": 4, "model": 2}, global_batch=96).fit(jax.devices())
    state_sharding = shardings_for(job.state_specs, mesh)
    batch_sharding = shardings_for(job.batch_spec, mesh)
    step_fn = jax.jit(
        job.step,
        in_shardings=(state_sharding, batch_sharding),
        out_shardings=(state_sharding, NamedSharding(mesh, P())),
    )

    def finish(step: int, metrics: Any, began: float) -> float:
        """Read ``step``'s loss; print its time from when the devices could start it. Returns when it ended."""
        float(metrics["loss"])
        ended = time.perf_counter()
        print(f"step {step} {ended - began:.6f}", flush=True)
        return ended

    options = ocp.CheckpointManagerOptions(save_interval_steps=max(save_every, 1), max_to_keep=2)
    manager = ocp.CheckpointManager(ckpt_dir, options=options) if save_every else None  # 0: the bare reference
    start = manager.latest_step() if manager is not None else None
    if start is None:
        state, start = jax.device_put(job.init(), state_sharding), 0
    else:
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), job.init(), state_sharding
        )
        assert manager is not None
        state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
    # The next batch loads in the background while a step computes, as the runtime does.
    loader = ThreadPoolExecutor(max_workers=1)
    upcoming = loader.submit(job.data.batch, start)
    in_flight: tuple[int, Any, float] | None = None  # pipelined: the step dispatched, its loss not yet read
    for step in range(start + 1, steps + 1):
        host_batch = upcoming.result()  # data loading is not step time, as in the runtime's accounting
        began = time.perf_counter()
        state, metrics = step_fn(state, jax.device_put(host_batch, batch_sharding))
        upcoming = loader.submit(job.data.batch, step)
        if pipelined:  # the previous step's loss is read once this one is queued behind it, as the runtime does
            if in_flight is not None:
                began = finish(*in_flight)
            in_flight = (step, metrics, began)
            continue
        finish(step, metrics, began)
        if manager is not None:
            manager.save(step, args=ocp.args.StandardSave(state))
    if in_flight is not None:
        finish(*in_flight)
    if manager is not None:
        manager.wait_until_finished()


def supervise(command: list[str], steps: int, fault_every: float | None) -> dict[str, Any]:
    """Run ``command`` until it reports ``steps``; with ``fault_every``, kill and restart it on schedule."""
    durations: dict[int, float] = {}
    started = time.monotonic()
    restarts = 0
    next_fault = fault_every
    while True:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        killed = threading.Event()
        if next_fault is not None:
            delay = started + next_fault - time.monotonic()

            def kill(
                proc: subprocess.Popen[str] = proc, delay: float = delay, killed: threading.Event = killed
            ) -> None:
                if not killed.wait(max(delay, 0)) and proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.set()

            threading.Thread(target=kill, daemon=True).start()
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step "):
                _, step, seconds = line.split()
                durations[int(step)] = float(seconds)  # a later run of the same step replaces the earlier
        proc.wait()
        if max(durations, default=0) >= steps and proc.returncode == 0:
            killed.set()
            break
        if not killed.is_set():
            raise RuntimeError(f"{command} exited with {proc.returncode} before step {steps}")
        restarts += 1
        assert next_fault is not None and fault_every is not None
        next_fault += fault_every
    return {"wall_s": time.monotonic() - started, "restarts": restarts, "durations": durations}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12000)
    parser.add_argument("--fault-every", type=float, default=60.0)
    parser.add_argument("--repair-after", type=float, default=20.0)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1, help="run every job this many times (medians)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-compile-cache", action="store_true", help="every process compiles cold")
    parser.add_argument("--child", choices=["runtime", "restart"], help=argparse.SUPPRESS)
    parser.add_argument("--mtbf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pipelined", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "runtime":
        return child_runtime(args.steps, args.dir, args.fault_every, args.repair_after, args.t0, args.mtbf)
    if args.child == "restart":
        return child_restart(args.steps, args.dir, args.save_every, args.pipelined)

    me = [sys.executable, __file__, "--steps", str(args.steps), "--fault-every", str(args.fault_every)]
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_compile_cache:  # read by JAX in every child process
            os.environ["JAX_COMPILATION_CACHE_DIR"] = f"{tmp}/compile-cache"
            os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

        def reference() -> float:
            """The bare step's median right now: the machine's speed drifts between jobs."""
            command = [sys.executable, __file__, "--steps", str(REFERENCE_STEPS), "--child", "restart"]
            run = supervise([*command, "--dir", f"{tmp}/reference", "--save-every", "0"], REFERENCE_STEPS, None)
            return statistics.median(run["durations"].values())

        def jobs(round_dir: str) -> dict[str, list[str]]:
            """Each round in its own directories: a job must not resume from the last round's checkpoints."""
            repair = ["--repair-after", str(args.repair_after)]
            return {
                "runtime": [*me, *repair, "--child", "runtime", "--dir", f"{round_dir}/rt"],
                "runtime_young_daly": [*me, *repair, "--child", "runtime", "--mtbf", "--dir", f"{round_dir}/yd"],
                "checkpoint_restart": [*me, "--child", "restart", "--dir", f"{round_dir}/ckpt", "--save-every",
                                       str(args.save_every)],
                "bare_loop": [*me, "--child", "restart", "--dir", f"{round_dir}/bare", "--save-every", "0"],
                "pipelined_loop": [*me, "--child", "restart", "--dir", f"{round_dir}/piped", "--save-every", "0",
                                   "--pipelined"],
            }  # fmt: skip

        before = reference()
        for round_number in range(args.rounds):
            for name, command in jobs(f"{tmp}/round{round_number}").items():
                if name == "checkpoint_restart":
                    run = supervise(command, args.steps, args.fault_every)
                elif name in ("bare_loop", "pipelined_loop"):
                    run = supervise(command, args.steps, None)
                else:
                    run = supervise([*command, "--t0", str(time.time())], args.steps, None)
                after = reference()
                run["reference_s"], before = (before + after) / 2, after
                run["goodput"] = args.steps * run["reference_s"] / run["wall_s"]
                run["median_step_s"] = statistics.median(run.pop("durations").values())
                runs.setdefault(name, []).append(run)
    result: dict[str, Any] = {
        "steps": args.steps,
        "fault_every_s": args.fault_every,
        "save_every": args.save_every,
        "rounds": args.rounds,
        "compile_cache": not args.no_compile_cache,
    }
    bare_walls = [run["wall_s"] for run in runs["bare_loop"]]

    def of_bare_loop(rounds: list[dict[str, Any]]) -> float:
        """The same steps' wall, the bare loop's over a job's in the same round (median over rounds)."""
        return statistics.median(bare / run["wall_s"] for bare, run in zip(bare_walls, rounds, strict=True))

    for name, rounds in runs.items():

        def median(key: str, rounds: list[dict[str, Any]] = rounds) -> float:
            return statistics.median(run[key] for run in rounds)

        result[name] = {
            "wall_s": round(median("wall_s"), 2),
            "goodput": round(median("goodput"), 4),
            "goodput_each_round": [round(run["goodput"], 4) for run in rounds],
            "of_bare_loop": round(of_bare_loop(rounds), 4),
            "restarts": max(run["restarts"] for run in rounds),
            "median_step_ms": round(median("median_step_s") * 1000, 3),
            "reference_step_ms": round(median("reference_s") * 1000, 3),
        }
    if args.json:
        print(json.dumps(result))
    else:
        for name in runs:
            row = result[name]
            print(f"{name:20s} goodput {row['goodput']:.1%} {row['goodput_each_round']}  of the bare loop's"
                  f" {row['of_bare_loop']:.1%}  wall {row['wall_s']} s"
                  f"  step {row['median_step_ms']} ms  reference {row['reference_step_ms']} ms")  # fmt: skip


if __name__ == "__main__":
    main()
