"""A launched run's start-up: seconds from ``elastic-runtime launch`` to the group's first step, with the workers
forked from the fork server (the default: one JAX import on the machine) against every worker started as a new
process (``--no-fork-spares``: one import each). Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_startup.py [--pairs 5] [--json]

Each pair runs the multi-process demo model on 4 processes (``bench_goodput_multiprocess.launch``, 200 steps, one
warm spare) once each way, in alternating order; every run has an empty replica folder, so its compiles are
cold. Per run, from the launch's start: ``started`` (the first ``WorkerStarted``), ``forming`` (the first
``GroupForming``: the first workers have said hello), ``first_step`` (the first ``StepCompleted``). Medians over
the pairs; the last line with ``--json`` holds them and their ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_runtime.core.events import GroupForming, StepCompleted, WorkerStarted

sys.path.insert(0, str(Path(__file__).parent))
from bench_goodput_multiprocess import NPROCS, launched

MODES = {"forked": [], "new_processes": ["--no-fork-spares"]}
STEPS = 200


def run_once(root: Path, extra: list[str]) -> dict[str, float]:
    began = time.time()
    events = launched(root, STEPS, extra)

    def first(kind: type) -> float:
        return next(e.wall_time for e in events if isinstance(e, kind)) - began

    return {"started": first(WorkerStarted), "forming": first(GroupForming), "first_step": first(StepCompleted)}


def alternating(
    pairs: int, jobs: dict[str, Callable[[Path], dict[str, float]]], unit: str
) -> tuple[dict[str, list[dict[str, float]]], list[float]]:
    """Each job run once a pair, the order alternating from pair to pair, each in a folder of its own: every
    job's figures (printed with ``unit`` as they come) and the load average before each run."""
    runs: dict[str, list[dict[str, float]]] = {job: [] for job in jobs}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(pairs):
            for job in list(jobs) if pair % 2 == 0 else list(jobs)[::-1]:
                loads.append(os.getloadavg()[0])
                root = Path(tmp) / f"{job}-{pair}"
                root.mkdir()
                run = jobs[job](root)
                runs[job].append(run)
                print(f"pair {pair + 1}/{pairs} {job}: " + ", ".join(f"{k} {v:.2f} {unit}" for k, v in run.items()))
    return runs, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the medians as JSON on the last line")
    args = parser.parse_args()
    jobs = {mode: functools.partial(run_once, extra=extra) for mode, extra in MODES.items()}
    runs, loads = alternating(args.pairs, jobs, "s")
    out: dict[str, Any] = {"nprocs": NPROCS, "pairs": args.pairs, "load_average_range": [min(loads), max(loads)]}
    for mode, rows in runs.items():
        out[mode] = {key: round(statistics.median(r[key] for r in rows), 3) for key in rows[0]}
    out["first_step_ratio"] = round(out["forked"]["first_step"] / out["new_processes"]["first_step"], 3)
    out["forming_ratio"] = round(out["forked"]["forming"] / out["new_processes"]["forming"], 3)
    for mode in MODES:
        print(f"{mode}: " + ", ".join(f"{k} {v:.2f} s" for k, v in out[mode].items()))
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
