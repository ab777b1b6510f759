"""Memory per worker process against the state's size (issue 29): 4 worker processes of
``tests/multiprocess/sharded_train.py`` (16 float32 arrays split over the slice's processes, an elementwise step)
under ``launch``, ``--slices 1`` and ``--slices 2``, with and without neighbour replicas, ``init`` under ``jit``
with per-process batches against a host-returning ``init`` with global batches. Per run: every member's and the
spare's peak RSS (``VmHWM``, from the workers' own reports: ``RunFinished.memory``) and the bytes each member read
from the data source for a step. The last line (``--json``) has, per configuration, ``rss_slope``: the fitted
slope of the members' largest peak RSS against the state's size (bytes of RSS per byte of state).

    .venv/bin/python tests/benchmarks/bench_memory.py [--mb 64 256] [--steps 6] [--configs NAME ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from elastic_runtime.cluster.config import LaunchConfig
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupFormed, RunFinished
from elastic_runtime.defaults import default_controller

SCRIPT = Path(__file__).resolve().parents[1] / "multiprocess" / "sharded_train.py"
CONFIGS = {
    "slices1-jit-rows": (1, False, ("--init", "jit", "--data", "process", "--split-batch")),
    "slices1-host-global": (1, False, ("--init", "host", "--data", "global", "--split-batch")),
    "slices1-jit-rows-neighbours": (1, True, ("--init", "jit", "--data", "process", "--split-batch")),
    "slices2-jit-rows": (2, False, ("--init", "jit", "--data", "process", "--split-batch")),
    "slices2-host-global": (2, False, ("--init", "host", "--data", "global", "--split-batch")),
}


def run(mb: float, slices: int, neighbours: bool, args: tuple[str, ...], steps: int, folder: Path) -> dict[str, Any]:
    config = LaunchConfig(
        command=[sys.executable, str(SCRIPT), "--steps", str(steps), "--mb", str(mb), *args],
        nprocs=4,
        slices=slices,
        run_dir=str(folder),
        target_steps=steps,
        replica_dir=str(folder / "replicas"),
        neighbour_replicas=neighbours,
        hang_timeout_s=300.0,
    )
    result = default_controller(config).run()
    if not result.ok:
        raise SystemExit(f"run failed: {result.reason}")
    events = read_events(result.events_path)
    (finished,) = [e for e in events if isinstance(e, RunFinished)]
    members = {str(w) for e in events if isinstance(e, GroupFormed) for w in e.members}
    memory = finished.memory
    return {
        "peak_rss": [memory[w]["peak_rss"] for w in sorted(members)],
        "spare_peak_rss": [m["peak_rss"] for w, m in memory.items() if w not in members],
        "batch_bytes": [memory[w]["batch"] for w in sorted(members)],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="default: all")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    summary: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        for name in args.configs:
            slices, neighbours, extra = CONFIGS[name]
            runs = {}
            for mb in args.mb:
                figures = run(mb, slices, neighbours, extra, args.steps, Path(tmp) / f"{name}-{mb}")
                runs[str(mb)] = figures
                print(name, f"{mb:g} MiB:", {k: [round(v / 2**20, 1) for v in vs] for k, vs in figures.items()})
            sizes = np.array(args.mb) * 2**20
            peaks = np.array([max(runs[str(mb)]["peak_rss"]) for mb in args.mb])
            slope = float(np.polyfit(sizes, peaks, 1)[0]) if len(sizes) > 1 else None
            summary[name] = {"rss_slope": slope, "runs": runs}
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
