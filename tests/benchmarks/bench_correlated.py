"""Correlated losses under ``elastic-runtime launch``: two workers killed at the same step against one. Not collected
by pytest.

    .venv/bin/python tests/benchmarks/bench_correlated.py [--runs 10] [--spares 1] [--json]

Each run is ``elastic-runtime launch --nprocs 4 --spares 1`` as a user types it (a subprocess: its own controller,
4 worker processes x 2 CPU devices and one warm spare, gloo on loopback) running the multi-process demo's job
(``runtime/cli/demo_multiprocess.py``) for ``--steps`` steps of at least ``--step-delay`` seconds. The controller
sends ``kill -9`` once the group has committed ``--kill-at``: to processes 2 and 3 (``--fault kill:2@K --fault
kill:3@K``, the same instant) or to process 2 alone; the two kinds are interleaved, ``--runs`` of each, and their
order alternates from one pair to the next. With one warm spare two losses need a second spare, started then:
forked from the launch's fork server (``runtime/cluster/controller/forkserver.py``), which imported JAX already,
rather than a new process importing it (2-5 s here); ``--spares 2`` keeps both warm.

Per run, from the run's event log (``events.jsonl``) and the launch's JSON summary:

- ``survivors_killed``: workers killed (``WorkerKilled``) that the faults did not name, and ``hung``, workers
  judged hung (``WorkerHung``); both must be 0: a survivor is never killed for waiting;
- ``reforms``: groups formed after the first (``GroupFormed``); one per correlated loss;
- ``next_commit_s``: from the first kill to the first step committed by the group formed after it;
- ``failures``: the failures the budget counted (``RecoveryStarted``), which must equal the kills;
- ``cold_spares``: spares started between the kill and the re-formed group;
- ``exact``: the final state against a fault-free run of the same launch, bitwise.

Each run prints a JSON line with the load average before and after it; the last line is the summary: medians,
ranges, ``ratio_two_over_one_next_commit`` (the goal: <= 2), the totals of survivors killed and the re-forms per
run. With ``--json`` the summary is one JSON line, else one ``key: value`` a line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_vs_torchft import spread  # (tests/benchmarks/, this script's folder)

from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import (
    GroupFormed,
    RecoveryStarted,
    StepCompleted,
    WorkerHung,
    WorkerKilled,
    WorkerStarted,
)
from elastic_runtime.storage.disk import DiskTier

NPROCS = 4
RUN_TIMEOUT_S = 600.0


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def launch(run_dir: Path, args: argparse.Namespace, faults: list[str]) -> dict[str, Any]:
    """``elastic-runtime launch`` in a subprocess; its JSON summary (the last line it prints)."""
    command = [
        sys.executable,
        "-m",
        "elastic_runtime.cli",
        "launch",
        "--nprocs",
        str(NPROCS),
        "--spares",
        str(args.spares),
    ]
    command += ["--run-dir", str(run_dir), "--result", str(run_dir / "final"), "--steps", str(args.steps)]
    command += [f"--fault={fault}" for fault in faults]
    command += [
        "--",
        sys.executable,
        "-m",
        "elastic_runtime.cli.demo_multiprocess",
        "--worker",
        "--steps",
        str(args.steps),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["ELASTIC_STEP_DELAY_S"] = str(args.step_delay)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    (run_dir / "launch.log").write_text(done.stderr)
    lines = done.stdout.strip().splitlines()
    try:
        return dict(json.loads(lines[-1]))
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "reason": f"exit {done.returncode}: {done.stderr[-2000:]}"}


def measure(run_dir: Path, summary: dict[str, Any], victims: set[int], reference: Path | None) -> dict[str, Any]:
    """One run's figures, from its event log; the faults name process ids, the events worker ids."""
    events = read_events(run_dir / "events.jsonl")
    formed = [e for e in events if isinstance(e, GroupFormed)]
    first = formed[0].members if formed else ()
    targets = {first[p] for p in victims if p < len(first)}  # the workers holding those process ids at the kill
    killed = [e for e in events if isinstance(e, WorkerKilled)]
    injected = [e for e in killed if e.reason.startswith("fault injection")]
    run: dict[str, Any] = {
        "ok": bool(summary.get("ok")),
        "reason": str(summary.get("reason", ""))[:300],
        "kills": len(injected),
        "survivors_killed": len([e for e in killed if e.worker not in targets]),
        "hung": len([e for e in events if isinstance(e, WorkerHung)]),
        "survivor_restarts": summary.get("survivor_restarts"),
        "reforms": len(formed) - 1,
        "failures": len([e for e in events if isinstance(e, RecoveryStarted)]),
        "strategies": summary.get("strategies"),
        "next_commit_s": None,
        "cold_spares": None,
        "exact": None,
    }
    if injected:
        kill_at = min(e.mono_time for e in injected)
        after = [e for e in formed if e.mono_time > kill_at]
        if after:
            commits = [e.mono_time for e in events if isinstance(e, StepCompleted) and e.mono_time > after[0].mono_time]
            run["next_commit_s"] = round(min(commits) - kill_at, 3) if commits else None
            started = [e for e in events if isinstance(e, WorkerStarted) and kill_at < e.mono_time < after[0].mono_time]
            run["cold_spares"] = len(started)
    if reference is not None and run["ok"]:
        got, want = (DiskTier(folder).latest(None).tree for folder in (run_dir / "final", reference))
        run["exact"] = bool(compare_states(got, want, bitwise=True)["match"])
    return run


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        figures = spread([r["next_commit_s"] for r in results if r["next_commit_s"] is not None])
        for stat in ("median", "min", "max"):
            summary[f"{name}_next_commit_s_{stat}"] = figures[stat]
        summary[f"{name}_ok"] = f"{sum(r['ok'] for r in results)}/{len(results)}"
        summary[f"{name}_no_survivor_killed"] = (
            f"{sum(r['survivors_killed'] == 0 and r['hung'] == 0 for r in results)}/{len(results)}"
        )
        summary[f"{name}_survivors_killed"] = sum(r["survivors_killed"] for r in results)
        summary[f"{name}_reforms"] = [r["reforms"] for r in results]
        summary[f"{name}_failures_counted"] = [r["failures"] for r in results]
        summary[f"{name}_cold_spares"] = [r["cold_spares"] for r in results]
        summary[f"{name}_exact"] = [r["exact"] for r in results]
    two, one = summary.get("two_next_commit_s_median"), summary.get("one_next_commit_s_median")
    summary["ratio_two_over_one_next_commit"] = round(two / one, 2) if two and one else None
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=10, help="runs of each kind (two kills, one), interleaved")
    parser.add_argument("--spares", type=int, default=1, help="warm spares (launch --spares; default 1)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10, help="the step after which the kills come")
    parser.add_argument("--step-delay", type=float, default=0.1, help="seconds added to each step")
    parser.add_argument("--json", action="store_true", help="the summary as one JSON line")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    args = parser.parse_args()

    kinds = {"two": [f"kill:2@{args.kill_at}", f"kill:3@{args.kill_at}"], "one": [f"kill:2@{args.kill_at}"]}
    victims = {"two": {2, 3}, "one": {2}}
    root = Path(tempfile.mkdtemp(prefix="bench-correlated-"))
    started = time.time()
    results: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "command": f"launch --nprocs {NPROCS} --spares {args.spares} --steps {args.steps}, kills at {args.kill_at}",
        "load_before": load_average(),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in kinds}
    try:
        reference_summary = launch(root / "reference", args, [])
        reference = root / "reference" / "final" if reference_summary.get("ok") else None
        if reference is None:
            print(f"the fault-free reference failed: {reference_summary.get('reason')}", file=sys.stderr)
        for repeat in range(args.runs):
            order = list(kinds) if repeat % 2 == 0 else list(reversed(kinds))
            for name in order:
                load = load_average()
                run_dir = root / f"{name}-{repeat}"
                summary = launch(run_dir, args, kinds[name])
                run = measure(run_dir, summary, victims[name], reference) if (run_dir / "events.jsonl").exists() else {}
                run = {"ok": False, "survivors_killed": 0, "hung": 0, "reforms": 0, "failures": 0} | run
                run.setdefault("next_commit_s", None)
                run.setdefault("cold_spares", None)
                run.setdefault("exact", None)
                run |= {"kind": name, "repeat": repeat, "load_before": load, "load_after": load_average()}
                runs[name].append(run)
                print(json.dumps(run, default=str), flush=True)
    except BaseException:
        print(f"stopped; run folders kept under {root}", file=sys.stderr)
        raise
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    results |= {"runs": args.runs, "load_after": load_average(), "seconds": round(time.time() - started, 1)}
    results |= summarize(runs)
    if args.json:
        print(json.dumps(results, default=str))
    else:
        print("\n".join(f"{k}: {v}" for k, v in results.items()))
    ok = all(r["ok"] for rs in runs.values() for r in rs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
