"""How short the heartbeat timeout can be before healthy workers are taken for lost: fault-free runs of the
multi-process demo under CPU load, counting every worker the controller judged lost or hung. Not collected by
pytest.

    .venv/bin/python tests/benchmarks/bench_heartbeat_false_positives.py [--settings 0.2/1/2 0.2/2] \\
        [--runs 3] [--seconds 60] [--burners 2] [--json]

Each run: the demo model as 3 worker processes (one warm spare), no fault injected, stepping for about
``--seconds`` (a step delay stretches the demo's steps), with ``--burners`` busy processes at the same priority
beside it (the load the chaos loop puts on a machine: more runnable processes than cores). A setting is
``interval/timeout[/start timeout]`` in seconds (the start timeout, before a worker's first step in its group,
is the timeout when not given). Every ``WorkerLost`` or ``WorkerHung`` is a false positive: nothing failed.
The figure per setting is the count over its runs and the rate per worker-hour of training, and the longest
silence between two heartbeats of one training worker (``longest_training_gap_s``; ``margin_s`` is the timeout
less it: how close the setting came to a false loss, which a count of zero does not say) and of any watched
worker (``longest_gap_s``, against the start timeout: ``start_margin_s``); the last line is JSON. Settings are
interleaved (A, B, A, B, ...): the machine's load drifts.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_vs_torchft import burning  # (tests/benchmarks/, this script's folder)

from elastic_runtime.cli.demo_multiprocess import run_group
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import StepCompleted, WorkerHung, WorkerLost

NPROCS = 3
STEP_DELAY_S = 0.05  # the demo's step takes milliseconds: stretched so a run lasts long enough to count


def one(interval_s: float, timeout_s: float, start_timeout_s: float, seconds: float, burners: int) -> dict[str, Any]:
    steps = max(50, round(seconds / STEP_DELAY_S))
    run_dir = Path(tempfile.mkdtemp(prefix="bench-heartbeat-"))
    started = time.monotonic()
    with burning(burners):
        result = run_group(
            processes=NPROCS,
            steps=steps,
            run_dir=run_dir,
            faults=[],
            heartbeat_interval_s=interval_s,
            heartbeat_timeout_s=timeout_s,
            heartbeat_start_timeout_s=start_timeout_s,
            extra_env={"ELASTIC_STEP_DELAY_S": str(STEP_DELAY_S)},
            start_timeout_s=300.0,
        )
    wall = time.monotonic() - started
    events = read_events(run_dir / "events.jsonl")
    completed = [e for e in events if isinstance(e, StepCompleted)]
    training_s = completed[-1].mono_time - completed[0].mono_time if len(completed) > 1 else 0.0
    return {
        "setting": f"{interval_s}/{timeout_s}/{start_timeout_s}",
        "ok": result.ok,
        "false_lost": sum(isinstance(e, WorkerLost) for e in events),
        "false_hung": sum(isinstance(e, WorkerHung) for e in events),
        "longest_training_gap_s": result.longest_training_heartbeat_gap_s,  # how close it came to a false loss
        "longest_gap_s": result.longest_heartbeat_gap_s,
        "training_s": round(training_s, 1),
        "wall_s": round(wall, 1),
        "load_average": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings", nargs="+", default=["0.2/1/2", "0.2/2"], help="interval/timeout[/start timeout], seconds"
    )
    parser.add_argument("--runs", type=int, default=3, help="runs per setting")
    parser.add_argument("--seconds", type=float, default=60.0, help="training time per run")
    parser.add_argument("--burners", type=int, default=2, help="busy processes beside each run")
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    args = parser.parse_args()
    settings = []
    for setting in args.settings:
        interval_s, timeout_s, *start = (float(x) for x in setting.split("/"))
        settings.append((interval_s, timeout_s, start[0] if start else timeout_s))
    runs = []
    for _ in range(args.runs):
        for interval_s, timeout_s, start_timeout_s in settings:
            run = one(interval_s, timeout_s, start_timeout_s, args.seconds, args.burners)
            runs.append(run)
            if not args.json:
                print(json.dumps(run), flush=True)
    summary: dict[str, Any] = {"burners": args.burners, "runs_per_setting": args.runs}
    for interval_s, timeout_s, start_timeout_s in settings:
        name = f"{interval_s}/{timeout_s}/{start_timeout_s}"
        mine = [r for r in runs if r["setting"] == name]
        false = sum(r["false_lost"] + r["false_hung"] for r in mine)
        worker_hours = sum(r["training_s"] for r in mine) * NPROCS / 3600
        summary[name] = {
            "false_positives": false,
            "per_worker_hour": round(false / worker_hours, 2) if worker_hours else None,
            "training_s": round(sum(r["training_s"] for r in mine), 1),
            "all_ok": all(r["ok"] for r in mine),
            "longest_training_gap_s": max(r["longest_training_gap_s"] for r in mine),
            "margin_s": round(timeout_s - max(r["longest_training_gap_s"] for r in mine), 3),
            "longest_gap_s": max(r["longest_gap_s"] for r in mine),
            "start_margin_s": round(start_timeout_s - max(r["longest_gap_s"] for r in mine), 3),
            "load_average": [r["load_average"] for r in mine],
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
