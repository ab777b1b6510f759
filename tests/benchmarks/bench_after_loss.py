"""Step time after a re-forming: a step abandoned in a collective with the lost peer, ended at the workers'
collective timeout (the runtime's default) against left to XLA's own (30 minutes). Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_after_loss.py [--steps 3500] [--kills 300 1500] [--repeats 2] [--json]

Each run trains the multi-process demo model under the controller (``launch --nprocs 4``, one warm spare, forked),
fault-free until the first of ``--kills`` steps, where the controller ``kill -9``s a member (a different one each
time). The defaults put the kills about 45 s apart, more than the 30 s collective timeout: two losses closer than
that can leave an old backend behind after all (docs/benchmarks.md, "Step time after a loss"). Its step time, as
the mean interval between committed steps:

- ``before``: from step 100 to the first kill;
- ``settling``: the first 35 s after the last kill (the default collective timeout is 30 s);
- ``after``: from 35 s after the last kill to the end.

``xla_default`` sets ``--xla_cpu_collective_timeout_seconds=1800`` in the workers' ``XLA_FLAGS`` (XLA's default;
the user's flag wins over the runtime's), ``timeout_30s`` sets 30 s (the runtime's default until 2026-12-05),
``runtime`` leaves the runtime's (10 s with the defaults). The chosen ``--contenders`` alternate, ``--repeats``
times each; the figures are medians over repeats. Also counted, from the workers' logs: steps abandoned in a
collective, those of them that ended, and each one's wait (``abandoned_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_runtime.cli.demo_multiprocess import group_controller
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import StepCompleted, WorkerKilled
from elastic_runtime.faults.grammar import Fault

sys.path.insert(0, str(Path(__file__).parent))
from bench_goodput_multiprocess import abandoned_waits
from bench_overhead_multiprocess import say

NPROCS = 4
SETTLE_S = 35.0
CONTENDERS = {
    "xla_default": "--xla_cpu_collective_timeout_seconds=1800",
    "timeout_30s": "--xla_cpu_collective_timeout_seconds=30",
    "runtime": "",
}


def mean_step(commits: list[tuple[int, float]]) -> float | None:
    """Mean interval between the first and last of ``commits`` (step, time), in ms."""
    if len(commits) < 2:
        return None
    (first_step, first_time), (last_step, last_time) = commits[0], commits[-1]
    return 1000 * (last_time - first_time) / (last_step - first_step)


def run(steps: int, kills: list[int], flag: str) -> dict[str, Any]:
    extra_env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()} if flag else {}
    faults = [Fault("kill", (i + 1) % NPROCS, step=step) for i, step in enumerate(kills)]
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder)
        controller = group_controller(
            processes=NPROCS, steps=steps, run_dir=run_dir, faults=faults, extra_env=extra_env
        )
        result = controller.run()
        if not result.ok:
            raise RuntimeError(f"run failed: {result.reason}")
        events = read_events(run_dir / "events.jsonl")
        logs = "".join(path.read_text() for path in (run_dir / "workers").glob("worker-*.log"))
        waits = abandoned_waits(run_dir / "workers")
    first: dict[int, float] = {}
    for event in events:
        if isinstance(event, StepCompleted) and event.step is not None:
            first.setdefault(event.step, event.mono_time)
    commits = sorted(first.items())
    last_kill = max(e.mono_time for e in events if isinstance(e, WorkerKilled))
    settled = last_kill + SETTLE_S
    return {
        "before": mean_step([c for c in commits if 100 <= c[0] <= kills[0]]),
        "settling": mean_step([c for c in commits if last_kill < c[1] <= settled]),
        "after": mean_step([c for c in commits if c[1] > settled]),
        "abandoned": len(re.findall(r"abandoning step \d+, blocked in a collective", logs)),
        "ended": len(re.findall(r"the abandoned step \d+ ended", logs)),
        "abandoned_s": waits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3500)
    parser.add_argument("--kills", type=int, nargs="+", default=[300, 1500])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--contenders", nargs="+", default=["xla_default", "runtime"], choices=list(CONTENDERS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.contenders}
    for repeat in range(args.repeats):
        for name in args.contenders:
            started = time.monotonic()
            runs[name].append(run(args.steps, args.kills, CONTENDERS[name]))
            say(f"repeat {repeat + 1}, {name}: {runs[name][-1]} ({time.monotonic() - started:.0f} s)")
    summary: dict[str, dict[str, Any]] = {}
    for name, results in runs.items():
        row: dict[str, Any] = {}
        for key in ("before", "settling", "after"):
            values = [r[key] for r in results if r[key] is not None]
            row[f"{key}_ms"] = round(statistics.median(values), 2) if values else None
        row["after_over_before"] = round(row["after_ms"] / row["before_ms"], 3) if row["after_ms"] else None
        row["abandoned"] = sum(r["abandoned"] for r in results)
        row["ended"] = sum(r["ended"] for r in results)
        row["abandoned_s"] = sorted(wait for r in results for wait in r["abandoned_s"])
        summary[name] = row
        print(f"{name:12s} {row}")
    if args.json:
        print(json.dumps({"steps": args.steps, "kills": args.kills, "repeats": args.repeats, "summary": summary}))


if __name__ == "__main__":
    main()
