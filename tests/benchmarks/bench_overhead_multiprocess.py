"""Steady-state cost of the multi-process runtime against a bare ``jax.distributed`` loop. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_overhead_multiprocess.py [--json] [--repeats 3] [--steps 120]
        [--mb 256] [--nprocs 3] [--big-nprocs 2] [--quick]

Contenders, on the same mesh (``data`` = one slice per process x ``model`` = its 2 CPU devices), model, data
and number of processes:

- ``bare``: N plain processes (this script with ``--bare-worker``) that ``jax.distributed.initialize`` on a
  local coordinator and run the runtime's own compiled step (``StepCompiler``) in a loop: the batch put on
  the mesh, the step, its result awaited; no snapshot, no controller;
- ``defaults``: the demo job under ``elastic-runtime launch`` (the Controller API, fault-free) with every
  default (a RAM replica of each step, a replica file of every 10th, heartbeats, each step's state written into
  a replaced one's buffers: ``runtime/cluster/worker/spares.py``);
- ``malloc_kept``: the defaults with ``ELASTIC_RETURN_FREED_MEMORY=0`` in the workers' environment (glibc's
  malloc left as it is: ``runtime/core/memory.py``);
- ``fresh_states`` and ``fresh_states_malloc_kept``: the same two with ``ELASTIC_SPARE_STATES=0`` (each step's
  state in fresh memory, the default before 2026-12-03's spare states).

A contender's step time is its mean step after the warm-up, from the warm-up's last step to the run's last
(the runtime's: its committed steps in the event log; the bare loop's: its process 0's steps; not the median
interval, which would leave out what comes every few steps only, like a replica file). Each repeat
runs the contenders one after another (A, B, C, A, B, C...), and each ratio is the median over the repeats
of the contender's time over the bare loop's *of the same repeat*: the shared machine's speed drifts by
more than the effects measured. Two sizes: the multi-process demo's model, and the demo MLP scaled to
about ``--mb`` MB of state per process (as ``bench_slices.py``), on ``--big-nprocs`` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_runtime.cli.demo_multiprocess import FEATURES, GLOBAL_BATCH, HIDDEN, group_controller, worker_command
from elastic_runtime.cluster.protocol import ENV_RETURN_FREED_MEMORY, ENV_SPARE_STATES
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import StepCompleted

CONTENDERS = ("bare", "defaults", "malloc_kept", "fresh_states", "fresh_states_malloc_kept")
# What each runtime contender changes in the launch config.
CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "malloc_kept": {"extra_env": {ENV_RETURN_FREED_MEMORY: "0"}},
    "fresh_states": {"extra_env": {ENV_SPARE_STATES: "0"}},
    "fresh_states_malloc_kept": {"extra_env": {ENV_SPARE_STATES: "0", ENV_RETURN_FREED_MEMORY: "0"}},
}
_STARTED = time.monotonic()


def say(message: str) -> None:
    """A progress line on stderr: minutes since the start, load, ``message``."""
    elapsed = (time.monotonic() - _STARTED) / 60
    print(f"[{elapsed:5.1f} min, load {os.getloadavg()[0]:.1f}] {message}", file=sys.stderr, flush=True)


def size_for(mb: float) -> int:
    """Features and hidden size (equal) giving about ``mb`` MB of state (parameters and momentum, float32)."""
    return max(64, int((mb * 2**20 / 8) ** 0.5) // 64 * 64)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bare_worker(args: argparse.Namespace) -> None:
    """One process of the bare loop: the runtime's compiled step in a plain ``jax.distributed`` loop."""
    import jax
    import numpy as np

    from elastic_runtime.core.compiler import StepCompiler
    from elastic_runtime.testing.demo_model import demo_job

    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.nprocs, process_id=args.process)
    job = demo_job(global_batch=GLOBAL_BATCH, features=args.features, hidden=args.hidden)
    template = job.init()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(args.nprocs, -1), ("data", "model"))
    compiler = StepCompiler(job, template, job.data.batch(0))
    compiled = compiler.get(mesh)

    def place(tree: Any, shardings: Any) -> Any:  # as the worker places its state and batches
        def one(sharding: Any, subtree: Any) -> Any:
            return jax.tree.map(
                lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x)[idx]),
                subtree,
            )

        return jax.tree.map(one, shardings, tree)

    state = place(template, compiler.state_shardings(mesh))
    times = [time.monotonic()]
    for position in range(args.steps):
        batch = place(job.data.batch(position), compiler.batch_shardings(mesh))
        state, _metrics = compiled(state, batch)
        jax.block_until_ready(state)
        times.append(time.monotonic())
    if args.process == 0:
        print("TIMES " + json.dumps(times), flush=True)
    jax.distributed.shutdown()


def run_bare(nprocs: int, steps: int, size: tuple[int, int], log: Path) -> list[float]:
    port = free_port()
    command = [sys.executable, __file__, "--bare-worker", "--port", str(port), "--nprocs", str(nprocs)]
    command += ["--steps", str(steps), "--features", str(size[0]), "--hidden", str(size[1])]
    with open(log, "wb") as out:
        procs = [
            subprocess.Popen([*command, "--process", str(i)], stdout=subprocess.PIPE if i == 0 else out, stderr=out)
            for i in range(nprocs)
        ]
        first, _ = procs[0].communicate(timeout=1200)
        codes = [procs[0].returncode] + [p.wait(timeout=120) for p in procs[1:]]
    if any(codes):
        raise RuntimeError(f"bare loop failed ({codes}): see {log}")
    line = next(x for x in first.decode().splitlines() if x.startswith("TIMES "))
    return [float(t) for t in json.loads(line[len("TIMES ") :])]


def run_runtime(root: Path, nprocs: int, steps: int, size: tuple[int, int], extra: dict[str, Any]) -> list[float]:
    command = worker_command(steps, features=size[0], hidden=size[1])
    # Wider timeouts than the defaults: a 256 MB step on 2 busy cores is no hang (no fault is injected here).
    timeouts = {"heartbeat_timeout_s": 60.0, "hang_timeout_s": 120.0, "spawn_timeout_s": 300.0}
    ctl = group_controller(processes=nprocs, steps=steps, run_dir=root, faults=[], command=command, **timeouts, **extra)
    result = ctl.run()
    if not result.ok:
        raise RuntimeError(f"runtime run failed: {result.reason} (see {root})")
    events = read_events(root / "events.jsonl")
    return [e.mono_time for e in events if isinstance(e, StepCompleted)]


def step_time(times: list[float], warmup: int) -> float:
    """The mean step after the first ``warmup``: from that step to the last, over the steps between. Not the
    median interval, which leaves out what comes every few steps only (a replica file every 10th step)."""
    window = times[warmup:]
    return (window[-1] - window[0]) / (len(window) - 1)


def measure(
    root: Path, label: str, nprocs: int, size: tuple[int, int], steps: int, warmup: int, repeats: int
) -> dict[str, Any]:
    samples: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for repeat in range(repeats):
        for contender in CONTENDERS:
            run_dir = root / f"{label}-{contender}-{repeat}"
            run_dir.mkdir(parents=True)
            if contender == "bare":
                times = run_bare(nprocs, steps, size, run_dir / "bare.log")
            else:
                times = run_runtime(run_dir, nprocs, steps, size, CONFIGS[contender])
            samples[contender].append(step_time(times, warmup))
            shutil.rmtree(run_dir, ignore_errors=True)  # replica files and the final state of 256 MB runs
            say(f"{label} repeat {repeat + 1}/{repeats} {contender}: {samples[contender][-1] * 1000:.2f} ms/step")
    bare = samples["bare"]
    result: dict[str, Any] = {
        "nprocs": nprocs,
        "features": size[0],
        "hidden": size[1],
        "state_mb_per_process": round(2 * 4 * (size[0] * size[1] + 2 * size[1]) / 2**20, 1),
        "steps": steps,
        "warmup": warmup,
    }
    for contender in CONTENDERS:
        result[f"{contender}_median_s"] = round(statistics.median(samples[contender]), 5)
    for contender in CONTENDERS[1:]:
        ratios = [t / b for t, b in zip(samples[contender], bare, strict=True)]
        result[f"{contender}_ratio"] = round(statistics.median(ratios), 3)
        result[f"{contender}_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (the last line)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120, help="steps per run at the demo size")
    parser.add_argument("--big-steps", type=int, default=25, help="steps per run at --mb")
    parser.add_argument("--mb", type=float, default=256.0, help="state per process of the large size (0: skip)")
    parser.add_argument("--nprocs", type=int, default=3, help="processes at the demo size")
    parser.add_argument("--big-nprocs", type=int, default=2, help="processes at --mb")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, few steps, 16 MB")
    # The bare loop's processes (internal).
    parser.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--process", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--features", type=int, default=FEATURES, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_worker:
        bare_worker(args)
        return
    if args.quick:
        args.repeats, args.steps, args.big_steps, args.mb, args.nprocs = 1, 30, 12, 16.0, 2
    root = Path(tempfile.mkdtemp(prefix="bench-overhead-mp-"))
    summary: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "repeats": args.repeats,
        "loadavg_start": Path("/proc/loadavg").read_text().split()[:3],
    }
    try:
        summary["demo"] = measure(
            root, "demo", args.nprocs, (FEATURES, HIDDEN), args.steps, min(20, args.steps // 3), args.repeats
        )
        if args.mb > 0:
            side = size_for(args.mb)
            label = f"{args.mb:g}mb"
            summary[label] = measure(
                root, label, args.big_nprocs, (side, side), args.big_steps, min(5, args.big_steps // 3), args.repeats
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    if args.json:
        print(json.dumps(summary))
    else:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
