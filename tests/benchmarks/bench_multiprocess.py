"""Multi-process benchmark: detection latency, recovery time by strategy, a torchrun-style full restart, and
the steady-state cost of heartbeats. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_multiprocess.py [--json out.json]

Every run: the demo model (runtime/cli/demo_multiprocess.py) as 3 worker processes x 2 CPU devices, gloo on loopback,
one warm spare. Kills are real signals sent by the controller once the group has committed the given step.
The full restart runs ``elastic-runtime launch`` as a subprocess that stops at the first failure
(``--max-failures 0``), then a fresh one (new controller, new workers, new JAX processes) that restores from
the replica files on local disk, as torchrun with ``--max-restarts`` and a disk checkpoint would.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_runtime.cli.demo_multiprocess import run_group, worker_command
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupFormed, StateRestored, StepCompleted, WorkerKilled
from elastic_runtime.faults.grammar import Fault

NPROCS = 3


def stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
        "min": round(min(values), 3),
    }


def repeated_kills(root: Path, strategy: str, signal: str, kills: int, every: int = 100) -> dict[str, Any]:
    """One run, ``kills`` failures ``every`` steps apart, rotating the process killed (0 included).

    100 steps (3-5 s here) leave the new warm spare time to start between failures; ``every=15`` measures
    back-to-back failures, where the replacement must be started from scratch.
    """
    plan = [Fault(signal.lower(), i % NPROCS, step=every * (i + 1)) for i in range(kills)]
    steps = every * (kills + 1)
    result = run_group(
        processes=NPROCS, steps=steps, run_dir=root / f"{strategy}-{signal}-{every}", faults=plan, strategy=strategy
    )
    assert result.ok, result.reason
    events = read_events(root / f"{strategy}-{signal}-{every}" / "events.jsonl")
    formed = [e.seconds for e in events if isinstance(e, GroupFormed) and e.strategy != "start"]
    kill_to_commit = [d + r["recovery_s"] for d, r in zip(result.detected_after_s, result.recoveries, strict=False)]
    return {
        "every_steps": every,
        "group_formed_s": stats(formed),
        "kill_to_first_commit_s": stats(kill_to_commit),
        "strategy": strategy,
        "signal": signal,
        "detected_after_s": stats(result.detected_after_s),
        "recovery_s": stats([r["recovery_s"] for r in result.recoveries]),
        "lost_steps": sum(r["lost_steps"] for r in result.recoveries),
        "survivor_restarts": result.survivor_restarts,
        "world_size_history": result.world_size_history,
        "strategies": result.strategies,
    }


def launch_cli(run_dir: Path, disk: Path, steps: int, extra: list[str]) -> int:
    command = [
        sys.executable,
        "-m",
        "elastic_runtime.cli",
        "launch",
        "--nprocs",
        str(NPROCS),
        "--run-dir",
        str(run_dir),
        "--replica-dir",
        str(disk),
        *extra,
        "--",
        *worker_command(steps),
    ]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{run_dir.name}.out", "wb") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def full_restart(root: Path, repeats: int, kill_at: int = 20, steps: int = 40) -> dict[str, Any]:
    """torchrun-style: the failure stops everything; a new controller and new workers restore from disk."""
    seconds: list[float] = []
    lost: list[int] = []
    for i in range(repeats):
        base = root / f"full-restart-{i}"
        disk = base / "disk"  # local disk, not /dev/shm
        first = launch_cli(base / "first", disk, steps, ["--max-failures", "0", "--fault", f"kill:1@{kill_at}"])
        assert first != 0, "the first run should stop at the failure"
        killed = next(e for e in read_events(base / "first" / "events.jsonl") if isinstance(e, WorkerKilled))
        committed = max(
            e.step or 0 for e in read_events(base / "first" / "events.jsonl") if isinstance(e, StepCompleted)
        )
        second = launch_cli(base / "second", disk, steps, [])
        assert second == 0, f"the restarted run failed: see {base}"
        events = read_events(base / "second" / "events.jsonl")
        restored = next(e for e in events if isinstance(e, StateRestored) or type(e).__name__ == "GroupFormed")
        restore_step = restored.step or 0
        first_commit = next(e for e in events if isinstance(e, StepCompleted) and (e.step or 0) > restore_step)
        seconds.append(first_commit.wall_time - killed.wall_time)
        lost.append(max(0, committed - restore_step))
    return {
        "strategy": "full restart (controller + workers, state from disk)",
        "recovery_s": stats(seconds),
        "lost_steps": lost,
    }


def heartbeat_cost(root: Path, steps: int = 150, rounds: int = 2) -> dict[str, Any]:
    """Fault-free runs at three heartbeat intervals, interleaved ``rounds`` times (the machine is shared).

    10 s leaves only the heartbeat sent with every committed step (the controller needs it to track commits);
    0.2 s is the default; 0.02 s is ten times the default. Reported: median step time, committed steps per
    second, and the controller's CPU seconds per 100 steps (it decodes every heartbeat).
    """
    samples: dict[float, list[tuple[float, float, float]]] = {10.0: [], 0.2: [], 0.02: []}
    for i in range(rounds):
        for interval in samples:
            run_dir = root / f"hb-{interval}-{i}"
            cpu = time.process_time()
            result = run_group(processes=NPROCS, steps=steps, run_dir=run_dir, faults=[], heartbeat_interval_s=interval)
            cpu = time.process_time() - cpu
            assert result.ok
            events = read_events(run_dir / "events.jsonl")
            durations = [e.duration_s for e in events if isinstance(e, StepCompleted)]
            commits = [e.wall_time for e in events if isinstance(e, StepCompleted)]
            rate = (len(commits) - 1) / (commits[-1] - commits[0])
            samples[interval].append((statistics.median(durations), rate, 100 * cpu / steps))
    return {
        f"interval_{interval}s": {
            "median_step_s": round(statistics.median(s[0] for s in values), 4),
            "steps_per_s": round(statistics.median(s[1] for s in values), 1),
            "controller_cpu_s_per_100_steps": round(statistics.median(s[2] for s in values), 3),
        }
        for interval, values in samples.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--kills", type=int, default=5, help="kills per repeated-kill run")
    parser.add_argument("--restarts", type=int, default=3, help="full-restart repetitions")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-mp-"))
    started = time.time()
    results: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "nprocs": NPROCS,
    }
    try:
        results["reform_kill9"] = repeated_kills(root, "reform", "KILL", args.kills)
        print(json.dumps(results["reform_kill9"]), flush=True)
        results["reform_kill9_back_to_back"] = repeated_kills(root, "reform", "KILL", 3, every=15)
        print(json.dumps(results["reform_kill9_back_to_back"]), flush=True)
        results["reform_sigstop"] = repeated_kills(root, "reform", "STOP", 3)
        print(json.dumps(results["reform_sigstop"]), flush=True)
        results["restart_kill9"] = repeated_kills(root, "restart", "KILL", 3)
        print(json.dumps(results["restart_kill9"]), flush=True)
        results["full_restart"] = full_restart(root, args.restarts)
        print(json.dumps(results["full_restart"]), flush=True)
        results["heartbeats"] = heartbeat_cost(root)
        print(json.dumps(results["heartbeats"]), flush=True)
        shutil.rmtree(root, ignore_errors=True)
    except BaseException:
        print(f"failed; run directories kept under {root}", file=sys.stderr)
        raise
    results["seconds"] = round(time.time() - started, 1)
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
