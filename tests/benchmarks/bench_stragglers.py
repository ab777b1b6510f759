"""Stragglers under launch (docs/multiprocess.md, Detection): the demo group of 4 workers and a warm spare,
``elastic-runtime demo --processes 4 --slow-worker 2:FACTOR@20``, every worker's step stretched by ``--step-delay``
(a bigger model's step). Per case, ``--runs`` runs: a worker 3x slower (found, replaced; the group's step time
before the slowdown, during it and after the replacement; bitwise equal to a fault-free run), 1.1x slower (below
the 1.5x factor: kept, no event), and no slow worker beside ``--burners`` CPU burners (false alarms: any
``Straggler`` at all). The last line is JSON with the medians.

    .venv/bin/python tests/benchmarks/bench_stragglers.py [--runs 3] [--steps 150] [--step-delay 0.1] \
        [--burners 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_vs_torchft import burning  # (tests/benchmarks/, this script's folder)

from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import Straggler

CASES = {"3x": "2:3@20", "1.1x": "2:1.1@20", "none": None}


def one(case: str, steps: int, step_delay: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "elastic_runtime.cli", "demo", "--processes", "4", "--steps", str(steps)]
        command += ["--step-delay", str(step_delay), "--run-dir", tmp, "--json", "--quiet"]
        slow = CASES[case]
        command += ["--slow-worker", slow, "--verify"] if slow else []
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        lines = done.stdout.strip().splitlines()
        if not lines:
            return {"case": case, "ok": False, "error": done.stderr[-2000:]}
        summary = json.loads(lines[-1])
        stragglers = [e for e in read_events(Path(tmp) / "run" / "events.jsonl") if isinstance(e, Straggler)]
        out = {"case": case, "ok": summary["ok"], "stragglers": len(stragglers)}
        if "straggler" in summary:
            out |= summary["straggler"] | {"bitwise": summary.get("reference_match", {}).get("match")}
        return out


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument("--burners", type=int, default=2, help="CPU burners beside the runs without a slow worker")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report: dict[str, Any] = {"load_average_before": os.getloadavg()}
    for case in CASES:
        runs = []
        for _ in range(args.runs):
            if case == "none":
                with burning(args.burners):
                    runs.append(one(case, args.steps, args.step_delay))
            else:
                runs.append(one(case, args.steps, args.step_delay))
            print(json.dumps(runs[-1]), flush=True)
        found = [r for r in runs if r.get("detected_step") is not None]
        report[case] = {
            "runs": len(runs),
            "ok": sum(bool(r["ok"]) for r in runs),
            "with_a_straggler_event": sum(r["stragglers"] > 0 for r in runs),
            "replaced": sum(r.get("action") == "replace" for r in runs),
            "bitwise": sum(r.get("bitwise") is True for r in runs),
            "steps_to_detect": statistics.median(r["detected_step"] - r["from_step"] for r in found) if found else None,
            "slowdown": median(runs, "slowdown"),
            "step_time_before_s": median(runs, "step_time_before_s"),
            "step_time_during_s": median(runs, "step_time_during_s"),
            "step_time_after_s": median(runs, "step_time_after_s"),
            "step_time_ratio_after": median(runs, "step_time_ratio_after"),
        }
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report) if args.json else json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
