"""The spread of the step, the runtime's against the bare ``jax.distributed`` loop's, back to back: is the slow
tail of steps in ``bench_goodput_multiprocess.py`` the runtime's or the machine's? Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_step_spread.py [--pairs 2] [--steps 4000] [--json]

Each pair runs, in alternating order, a fault-free ``launch --nprocs 4`` of the multi-process demo model
(``bench_goodput_multiprocess.launch``: defaults, one warm spare) and the bare loop of the same model on 4
processes (``bench_overhead_multiprocess.run_bare``). Per run, over the intervals between steps after the first
50: the median, the mean and the 90th and 99th percentiles, in ms. Medians over the pairs, and the ratio of the
runtime's mean step to the bare loop's (the goodput benchmark's steps are counted by their mean).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from elastic_runtime.cli.demo_multiprocess import FEATURES, HIDDEN
from elastic_runtime.core.events import StepCompleted

sys.path.insert(0, str(Path(__file__).parent))
from bench_goodput_multiprocess import NPROCS, launched
from bench_overhead_multiprocess import run_bare
from bench_startup import alternating

WARMUP = 50


def spread(times: list[float]) -> dict[str, float]:
    """Median, mean, p90 and p99 of the intervals between ``times`` (seconds) after the warm-up, in ms."""
    steps = sorted(b - a for a, b in itertools.pairwise(times[WARMUP:]))
    ms = {"median": statistics.median(steps), "mean": statistics.mean(steps)}
    ms |= {f"p{q}": steps[len(steps) * q // 100] for q in (90, 99)}
    return {k: round(v * 1e3, 2) for k, v in ms.items()}


def runtime_run(root: Path, steps: int) -> dict[str, float]:
    return spread([e.mono_time for e in launched(root, steps, []) if isinstance(e, StepCompleted)])


def bare_run(root: Path, steps: int) -> dict[str, float]:
    return spread(run_bare(NPROCS, steps, (FEATURES, HIDDEN), root / "bare.log"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--json", action="store_true", help="print the medians as JSON on the last line")
    args = parser.parse_args()
    jobs = {
        job: functools.partial(run, steps=args.steps) for job, run in (("runtime", runtime_run), ("bare", bare_run))
    }
    runs, loads = alternating(args.pairs, jobs, "ms")
    out: dict[str, Any] = {"nprocs": NPROCS, "pairs": args.pairs, "steps": args.steps}
    out["load_average_range"] = [min(loads), max(loads)]
    for job, rows in runs.items():
        out[job] = {key: round(statistics.median(r[key] for r in rows), 2) for key in rows[0]}
    out["mean_ratio"] = round(out["runtime"]["mean"] / out["bare"]["mean"], 3)
    print(f"runtime/bare, mean step: {out['mean_ratio']}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
