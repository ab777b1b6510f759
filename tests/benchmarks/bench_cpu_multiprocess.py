"""CPU a step of a fault-free multi-process run: the controller's and its workers' together. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_cpu_multiprocess.py [--nprocs 3] [--short 100] [--long 500]
        [--config '{"replica_file_every": 1}']

CPU time is what a shared machine disturbs least: runs of ``--short`` and ``--long`` steps of the demo job under
``launch`` (no spare, so that no idle process is counted), after one run that pays the imports and first
compiles; the difference over the steps between cancels every fixed cost. The controller runs in this process
(``getrusage(RUSAGE_SELF)``); the workers are its children, counted once they are waited for
(``RUSAGE_CHILDREN``). Prints one line of JSON: milliseconds of CPU a step for each, and of wall time.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from runtime.cli.demo_multiprocess import group_controller


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=3)
    parser.add_argument("--short", type=int, default=100)
    parser.add_argument("--long", type=int, default=500)
    parser.add_argument("--config", default="{}", help="LaunchConfig fields, as JSON")
    args = parser.parse_args()
    config = json.loads(args.config)
    run(args.nprocs, 20, config)  # imports and first compiles
    short, long = run(args.nprocs, args.short, config), run(args.nprocs, args.long, config)
    steps = args.long - args.short
    controller_ms, workers_ms, wall_ms = (1000 * (b - a) / steps for a, b in zip(short, long, strict=True))
    print(json.dumps({"config": config, "controller_ms": controller_ms, "workers_ms": workers_ms, "wall_ms": wall_ms}))


if __name__ == "__main__":
    main()
