"""Goodput of a multi-process job under one fault a minute: the runtime against checkpoint-and-restart of
every worker, same model, same schedule. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_goodput_multiprocess.py [--steps 5000] [--fault-every 60]
        [--rounds 3] [--durable-every 100] [--json]

The jobs train the multi-process demo model (``elastic_runtime.cli.demo_multiprocess``) as ``elastic-runtime launch
--nprocs 4`` (2 CPU devices a process, gloo on loopback) for ``--steps`` steps, and this script sends
``SIGKILL`` to one member worker (a different one each time) every ``--fault-every`` seconds of wall time:

- ``runtime``: ``launch`` with its defaults (a warm spare, the group re-formed in place from the survivors'
  RAM replicas and the replica files);
- ``checkpoint_restart``: ``launch --max-failures 0 --spares 0 --durable DIR --durable-every N``: the first
  loss stops every worker, and this script starts a new ``launch`` (new controller, new workers, new JAX
  processes, fresh replica files) which restores every process from the newest durable checkpoint in
  ``DIR``, as a job restarted by its scheduler from its checkpoint would; detection and rescheduling are left
  out in its favour;
- ``bare_loop``: the reference's plain ``jax.distributed`` loop (below) for all the steps, started cold and
  without faults: what a job with no fault, no checkpoint and no runtime scores by the same measure.

Two goodputs per job, from the wall time between the first ``launch`` and the end of the last:

- ``goodput``: steps x the bare step / wall, where the bare step is the mean step of a plain
  ``jax.distributed`` loop of the same step on the same mesh (``bench_overhead_multiprocess.py``'s ``bare``),
  run before and after each job (the mean of the two: the shared machine's speed drifts). Every other cost is
  charged to the job: start-up, the runtime's per-step work (replicas, heartbeats; ``docs/benchmarks.md``,
  "Multi-process steady state"), checkpoints, restarts, recoveries, re-done steps;
- ``goodput_own_step``: steps x the job's own median committed-step interval / wall: what the faults and the
  starts cost, with the per-step overhead counted as productive (as ``ml-goodput-measurement`` counts a step).

With the bare loop among the jobs, ``of_bare_loop``: its wall over a job's in the same round (the same steps,
the bare loop as 100%): a reference as long as the job, run minutes from it, where the bare step's runs take
seconds.

And where each job's wall time went, from its event log: ``first_commit_s`` (start-up: imports, the first
group, compiles), ``stalls_s`` (gaps of more than 10 steps between two commits: recoveries, relaunches),
``stepping_s`` (every other interval between commits) and ``after_last_commit_s``; from its workers' logs, each
round's ``abandoned_s``: how long each survivor's step left blocked in a collective by a kill took to end (one
that waits for gloo's collective timeout, 10 s by default, slows the group's steps until then).

The workers cache their compiles in their replica folder (``<replica-dir>/xla-cache``, the launcher's
default). Checkpoint-and-restart relaunches keep that folder and lose everything else in it (replica files,
kept programs): each loads its compiled programs from the cache, as a job restarted with a persistent cache
would. With ``--rounds N`` each job runs N times in turn; figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from elastic_runtime.cli.demo_multiprocess import FEATURES, HIDDEN, worker_command
from elastic_runtime.core.eventlog import decode_event, read_events
from elastic_runtime.core.events import GroupFormed, RecoveryCompleted, StepCompleted, WorkerStarted

sys.path.insert(0, str(Path(__file__).parent))
from bench_overhead_multiprocess import run_bare, say, step_time

NPROCS = 4
BARE_STEPS, BARE_WARMUP = 600, 100
JOBS = ("runtime", "checkpoint_restart", "bare_loop")


def live_events(log: Path) -> list[Any]:
    """The events of a log being written (its last line may be half written)."""
    written = log.read_bytes() if log.exists() else b""
    return [decode_event(line) for line in written[: written.rfind(b"\n") + 1].splitlines() if line.strip()]


def members(events: list[Any]) -> list[int]:
    """The pids of the newest formed group's members, in worker order ([] before the first group forms)."""
    pids = {e.worker: e.pid for e in events if isinstance(e, WorkerStarted)}
    formed = [e for e in events if isinstance(e, GroupFormed)]
    return [pids[w] for w in sorted(formed[-1].members)] if formed else []


def launch(run_dir: Path, replicas: Path, steps: int, extra: list[str]) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "elastic_runtime.cli",
        "launch",
        "--nprocs",
        str(NPROCS),
        "--run-dir",
        str(run_dir),
    ]
    command += ["--replica-dir", str(replicas), *extra, "--", *worker_command(steps)]
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / "launch.out", "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def launched(root: Path, steps: int, extra: list[str]) -> list[Any]:
    """The events of one fault-free :func:`launch` under ``root``, with an empty replica folder of its own
    (cold compiles) removed after it; exits with the launch's output if it failed."""
    replicas = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="bench-launch-"))
    try:
        code = launch(root / "run", replicas, steps, extra).wait()
    finally:
        shutil.rmtree(replicas, ignore_errors=True)
    if code != 0:
        raise SystemExit(f"launch exited with {code}:\n{(root / 'launch.out').read_text()[-3000:]}")
    return read_events(root / "run" / "events.jsonl")


def run_job(job: str, root: Path, shm: Path, steps: int, fault_every: float, durable_every: int) -> dict[str, Any]:
    """One job under the kill schedule; checkpoint-and-restart is launched again (``--resume``, fresh replica
    files: only the durable checkpoints hold its state) after each loss stopped it."""
    run_dir, log = root / "run", root / "run" / "events.jsonl"
    extra = [] if job == "runtime" else ["--max-failures", "0", "--spares", "0", "--durable", str(root / "durable")]
    extra += [] if job == "runtime" else ["--durable-every", str(durable_every)]
    started = time.monotonic()
    next_fault, kills, launches, lost, newest = started + fault_every, 0, 0, 0, 0
    while True:
        formed_before = len([e for e in live_events(log) if isinstance(e, GroupFormed)])
        replicas = shm / root.name
        for kept in replicas.glob("*") if replicas.exists() else []:  # a relaunch keeps only the compile cache
            if kept.is_dir() and kept.name != "xla-cache":
                shutil.rmtree(kept)
            elif kept.is_file():
                kept.unlink()
        proc = launch(run_dir, replicas, steps, [*extra, *(["--resume"] if launches else [])])
        launches += 1
        killed_here = False
        while proc.poll() is None:
            if time.monotonic() >= next_fault and (pids := members(live_events(log))):
                try:
                    os.kill(pids[kills % len(pids)], signal.SIGKILL)
                except ProcessLookupError:  # it exited: the run is ending (or its loss is not in the log yet)
                    time.sleep(0.05)
                    continue
                say(f"{job}: killed a worker at {time.monotonic() - started:.0f} s")
                kills, killed_here, next_fault = kills + 1, True, next_fault + fault_every
            time.sleep(0.05)
        if launches > 1:  # the steps this launch computed again: from its restored step to the last one's newest
            restored = [e.restore_step for e in read_events(log) if isinstance(e, GroupFormed)][formed_before]
            lost += max(0, newest - restored)
        if proc.returncode == 0:
            break
        if job == "runtime" or not killed_here:
            kept = Path(tempfile.mkdtemp(prefix=f"goodput-failed-{job}-"))
            shutil.copytree(root, kept, dirs_exist_ok=True)  # the run folder goes with the temporary one
            raise RuntimeError(f"{job} launch exited with {proc.returncode}: see {kept / 'launch.out'}")
        newest = max(e.step or 0 for e in read_events(log) if isinstance(e, StepCompleted))
    ended = time.monotonic()
    events = read_events(log)
    commits = [e.mono_time for e in events if isinstance(e, StepCompleted)]
    return {
        **wall_parts(started, ended, commits),
        "kills": kills,
        "launches": launches,
        "lost_steps": lost + sum(e.lost_steps for e in events if isinstance(e, RecoveryCompleted)),
        "abandoned_s": abandoned_waits(run_dir / "workers"),
    }


def run_bare_loop(root: Path, steps: int) -> dict[str, Any]:
    """The bare ``jax.distributed`` loop (the reference's) for all the steps, started cold, without faults; its
    start-up and its processes' exit are charged to it as to the jobs."""
    root.mkdir(parents=True)
    started = time.monotonic()
    commits = run_bare(NPROCS, steps, (FEATURES, HIDDEN), root / "bare.log")[1:]  # [0]: before the first step
    parts = wall_parts(started, time.monotonic(), commits)
    return {**parts, "kills": 0, "launches": 1, "lost_steps": 0, "abandoned_s": []}


def wall_parts(started: float, ended: float, commits: list[float]) -> dict[str, Any]:
    """Where the wall time went, from the commits' times on this clock (CLOCK_MONOTONIC, the controller's and
    the workers'): before the first commit, after the last, the gaps between commits of more than 10 steps
    (recoveries, relaunches), the steps; and the median interval between commits."""
    intervals = [b - a for a, b in itertools.pairwise(commits)]
    own_step = statistics.median(i for i in intervals if i > 0)
    stalls = [i for i in intervals if i > 10 * own_step]
    return {
        "wall_s": ended - started,
        "own_step_s": own_step,
        "first_commit_s": commits[0] - started,
        "after_last_commit_s": ended - commits[-1],
        "stalls_s": sum(stalls),
        "stalls": len(stalls),
        "stepping_s": sum(i for i in intervals if i <= 10 * own_step),
    }


_LOGGED = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*"


def abandoned_waits(workers: Path) -> list[float]:
    """Seconds from each survivor's step abandoned in a collective with a killed worker to that step's end (its
    thread blocked meanwhile; a wait that lasts until gloo's collective timeout, 10 s by default, slows the group's
    steps: docs/multiprocess.md, "JAX limits met"), from the workers' logs; an abandoned step that never ended is
    left out."""
    waits = []
    for log in workers.glob("worker-*.log"):
        text = log.read_text(errors="replace")
        begun = {m[2]: m[1] for m in re.finditer(_LOGGED + r"abandoning step (\d+), blocked", text, re.MULTILINE)}
        for m in re.finditer(_LOGGED + r"the abandoned step (\d+) ended", text, re.MULTILINE):
            if m[2] in begun:
                start, end = (datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t in (begun[m[2]], m[1]))
                waits.append(round((end - start).total_seconds(), 2))
    return sorted(waits)


def bare_step() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        times = run_bare(NPROCS, BARE_STEPS, (FEATURES, HIDDEN), Path(tmp) / "bare.log")
    return step_time(times, BARE_WARMUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--fault-every", type=float, default=60.0)
    parser.add_argument("--durable-every", type=int, default=100, help="checkpoint-and-restart's save cadence")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {job: [] for job in args.jobs}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        before = bare_step()
        for round_number in range(args.rounds):
            for job in args.jobs:
                root = Path(tmp) / f"{job}-{round_number}"
                if job == "bare_loop":
                    run = run_bare_loop(root, args.steps)
                else:
                    run = run_job(job, root, Path(shm), args.steps, args.fault_every, args.durable_every)
                after = bare_step()
                run["bare_step_s"], before = (before + after) / 2, after
                run["goodput"] = args.steps * run["bare_step_s"] / run["wall_s"]
                run["goodput_own_step"] = args.steps * run["own_step_s"] / run["wall_s"]
                runs[job].append(run)
                load.append(os.getloadavg()[0])
                say(f"round {round_number + 1}/{args.rounds} {job}: goodput {run['goodput']:.1%}, by its own step "
                    f"{run['goodput_own_step']:.1%}, wall {run['wall_s']:.1f} s, {run['kills']} kills")  # fmt: skip
                shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {
        "nprocs": NPROCS,
        "steps": args.steps,
        "fault_every_s": args.fault_every,
        "durable_every": args.durable_every,
        "rounds": args.rounds,
        "load_average_range": [min(load), max(load)],
    }
    for job, rounds in runs.items():
        result[job] = {
            key: round(statistics.median(run[key] for run in rounds), 4)
            for key in (
                "goodput",
                "goodput_own_step",
                "wall_s",
                "own_step_s",
                "bare_step_s",
                "lost_steps",
                "first_commit_s",
                "after_last_commit_s",
                "stalls_s",
                "stepping_s",
            )
        }
        result[job]["goodput_each_round"] = [round(run["goodput"], 4) for run in rounds]
        if "bare_loop" in runs:  # the same steps' wall against the bare loop's in the same round
            ratios = [bare["wall_s"] / run["wall_s"] for bare, run in zip(runs["bare_loop"], rounds, strict=True)]
            result[job]["of_bare_loop"] = round(statistics.median(ratios), 4)
        result[job]["kills"] = [run["kills"] for run in rounds]
        result[job]["launches"] = [run["launches"] for run in rounds]
        result[job]["abandoned_s"] = [run["abandoned_s"] for run in rounds]
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
