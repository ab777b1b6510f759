"""CPU a step of a fault-free multi-process run: the controller's and its workers' together. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_cpu_multiprocess.py [--nprocs 3] [--short 100] [--long 500]
        [--config '{"replica_file_every": 1}'] [--bare]

CPU time is what a shared machine disturbs least: runs of ``--short`` and ``--long`` steps of the demo job under
``launch`` (no spare, so that no idle process is counted), after one run that pays the imports and first
compiles; the difference over the steps between cancels every fixed cost. The controller runs in this process
(``getrusage(RUSAGE_SELF)``); the workers are its children, counted once they are waited for
(``RUSAGE_CHILDREN``). Prints one line of JSON: milliseconds of CPU a step for each, and of wall time. ``--bare``
adds the same measure of the bare ``jax.distributed`` loop of ``bench_overhead_multiprocess.py`` (same step,
mesh, data and processes, no runtime), its ``bare_ms``.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_runtime.cli.demo_multiprocess import group_controller


def cpu_s(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def run(nprocs: int, steps: int, config: dict[str, Any]) -> tuple[float, float, float]:
    """Seconds of the controller's CPU, its workers' CPU and wall time for a run of ``steps``."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as run_dir:
        controller = group_controller(
            processes=nprocs, steps=steps, run_dir=Path(run_dir), faults=[], spares=0, fork_spares=False, **config
        )
        result = controller.run()
        if not result.ok:
            raise RuntimeError(f"run failed: {result.reason}")
    wall = time.monotonic() - started
    own_after, children_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return cpu_s(own_after) - cpu_s(own), cpu_s(children_after) - cpu_s(children), wall


def run_bare(nprocs: int, steps: int) -> tuple[float, float, float]:
    """The bare loop's processes: (0, their CPU, wall) for a run of ``steps``."""
    from bench_overhead_multiprocess import run_bare as bare_processes

    from elastic_runtime.cli.demo_multiprocess import FEATURES, HIDDEN

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as log_dir:
        bare_processes(nprocs, steps, (FEATURES, HIDDEN), Path(log_dir) / "bare.log")
    wall = time.monotonic() - started
    return 0.0, cpu_s(resource.getrusage(resource.RUSAGE_CHILDREN)) - cpu_s(children), wall


def per_step(short: tuple[float, float, float], long: tuple[float, float, float], steps: int) -> list[float]:
    return [1000 * (b - a) / steps for a, b in zip(short, long, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=3)
    parser.add_argument("--short", type=int, default=100)
    parser.add_argument("--long", type=int, default=500)
    parser.add_argument("--config", default="{}", help="LaunchConfig fields, as JSON")
    parser.add_argument("--bare", action="store_true", help="also the bare jax.distributed loop")
    args = parser.parse_args()
    config = json.loads(args.config)
    steps = args.long - args.short
    run(args.nprocs, 20, config)  # imports and first compiles
    short, long = run(args.nprocs, args.short, config), run(args.nprocs, args.long, config)
    controller_ms, workers_ms, wall_ms = per_step(short, long, steps)
    result = {"config": config, "controller_ms": controller_ms, "workers_ms": workers_ms, "wall_ms": wall_ms}
    if args.bare:
        _, result["bare_ms"], result["bare_wall_ms"] = per_step(
            run_bare(args.nprocs, args.short), run_bare(args.nprocs, args.long), steps
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
