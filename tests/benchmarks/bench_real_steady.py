"""Steady step time of a real model under ``launch --nprocs 4 --slices 2``, fault-free: the workers' defaults
against ``ELASTIC_RETURN_FREED_MEMORY=0`` (glibc's malloc left as it is, ``runtime/core/memory.py``) and
``ELASTIC_SPARE_STATES=0`` (each step's state in fresh memory, ``runtime/cluster/worker/spares.py``), in turn.
Not collected by pytest.

    .venv-maxtext/bin/python tests/benchmarks/bench_real_steady.py [--models flax maxtext] [--repeats 2]
        [--steps 60] [--warmup 15] [--json]

A run's step time is its mean committed step from step ``--warmup`` to the last (the controller's event log).
The last line is JSON: per model, each mode's times and the median of its paired ratios to the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_real_recovery import command

from elastic_runtime.cli.demo_multiprocess import group_controller
from elastic_runtime.cluster.protocol import ENV_RETURN_FREED_MEMORY, ENV_SPARE_STATES
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import StepCompleted

MODES = {"defaults": {}, "malloc_kept": {ENV_RETURN_FREED_MEMORY: "0"}, "fresh_states": {ENV_SPARE_STATES: "0"}}


def step_time(model: str, env: dict[str, str], steps: int, warmup: int) -> float:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-steady-{model}-"))
    try:
        # Wide timeouts: the first formation imports and compiles a real model in every worker.
        controller = group_controller(
            processes=4,
            steps=steps,
            run_dir=run_dir,
            faults=[],
            command=command(model, steps),
            slices=2,
            extra_env=env,
            spawn_timeout_s=900.0,
            heartbeat_timeout_s=60.0,
            hang_timeout_s=300.0,
        )
        result = controller.run()
        if not result.ok:
            raise RuntimeError(f"{model} run failed: {result.reason} (see {run_dir})")
        times = {e.step: e.mono_time for e in read_events(run_dir / "events.jsonl") if isinstance(e, StepCompleted)}
        return (times[steps] - times[warmup]) / (steps - warmup)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["flax", "maxtext"], choices=["flax", "maxtext"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    args = parser.parse_args()
    summary: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    for model in args.models:
        samples: dict[str, list[float]] = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode, env in MODES.items():
                samples[mode].append(step_time(model, env, args.steps, args.warmup))
                if not args.json:
                    print(
                        f"{model} {repeat + 1}/{args.repeats} {mode}: {samples[mode][-1] * 1000:.1f} ms a step "
                        f"(load {os.getloadavg()[0]:.1f})",
                        file=sys.stderr,
                        flush=True,
                    )
        summary[model] = {mode: [round(t, 5) for t in ts] for mode, ts in samples.items()} | {
            f"{mode}_over_defaults": round(
                statistics.median(t / d for t, d in zip(samples[mode], samples["defaults"], strict=True)), 3
            )
            for mode in MODES
            if mode != "defaults"
        }
    summary["loadavg_end"] = os.getloadavg()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
