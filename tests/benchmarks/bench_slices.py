"""Sharded state across processes (issue 19): a lost process's shards from the other slice, or from GCS only
for that process, against a full restart of every process from GCS. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_slices.py [--mb 32] [--repeats 3] [--json out.json]

The demo model (``runtime/testing/demo_model.py``) scaled to about ``--mb`` MB of state (parameters and
momentum; as many features as hidden units; the hidden layer sharded over the ``model`` axis), 30 steps,
each case a fresh run:

- ``slices``: 2 slices x 2 processes x 2 CPU devices; ``kill -9`` of process 1 at step 15; its replacement
  takes its shards from the other slice (nothing read from storage);
- ``gcs_in_place``: 1 slice x 4 processes, durable checkpoints every 5 steps in GCS (the emulator); ``kill -9``
  of process 2 once durable step 10 is committed (steps slowed to 0.2 s: uploads to the emulator are slow),
  and its replica files deleted (its host's ``/dev/shm``): the survivors keep their shards, the group rolls
  back to the newest durable step, and only the lost process's shards come from GCS;
- ``gcs_neighbours``: the same with neighbour replicas on (``neighbour_replicas``): the next process keeps the
  lost process's shards in RAM, and nothing is read from GCS;
- ``gcs_full_restart``: the same run stopped at the kill (``max_failures=0``), then every process started
  again (``resume``, an empty replica folder: new hosts) restoring the whole state from GCS.

Times are from the kill (the controller's ``WorkerKilled``; every process here shares the machine's monotonic
clock) to the first step committed after it. Bytes per tier come from the workers' reports (``Restored``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from runtime.cli.demo_multiprocess import group_controller, wipe_lost_replicas, worker_command
from runtime.cluster.protocol import ENV_STEP_DELAY_S
from runtime.core.errors import RecoveryError
from runtime.core.eventlog import read_events
from runtime.core.events import CheckpointCommitted, RunStarted, StateRestored, StepCompleted, WorkerKilled
from runtime.testing.compare import compare_states
from runtime.testing.gcs_emulator import running_emulator
from runtime.testing.grammar import Fault
from storage.disk import DiskTier

STEPS, KILL_AT, EVERY = 30, 15, 5


def size_for(mb: float) -> int:
    """The features and hidden size (equal) giving about ``mb`` MB of state: parameters and momentum,
    2 x 4 x (F x H + 2 H) bytes. Square, so that the demo's learning rate stays stable."""
    return max(64, int((mb * 2**20 / 8) ** 0.5) // 64 * 64)


def controller(run_dir: Path, size: int, **kwargs: Any) -> Any:
    command = worker_command(STEPS, features=size, hidden=size)
    return group_controller(steps=STEPS, run_dir=run_dir, command=command, **kwargs)


def kill_once_committed(ctl: Any, step: int) -> None:
    """``kill -9`` of process 2 once durable step ``step`` (or a later one) is committed: GCS uploads to the
    emulator take a few steps, and the loss must find a durable step to go back to in both cases."""
    done = False

    async def kill(event: CheckpointCommitted, ctx: Any) -> None:
        nonlocal done
        if event.step >= step and not done:
            done = True
            ctx.signal(ctx.members[2], "KILL", "benchmark: its host is lost")

    ctl.bus.subscribe(CheckpointCommitted, kill)


def kill_time(events_path: str) -> float:
    return next(e.mono_time for e in read_events(events_path) if isinstance(e, WorkerKilled))


def first_commit_after(events_path: str, killed: float) -> tuple[float, int]:
    """(time, step) of the first step trained and committed by the group formed after the kill (not a step
    the old group finished as the kill landed, nor one counted on a restore)."""
    events = read_events(events_path)
    formed = next(e.mono_time for e in events if isinstance(e, StateRestored | RunStarted) and e.mono_time > killed)
    for event in events:
        if isinstance(event, StepCompleted) and event.mono_time > formed and event.duration_s > 0:
            return event.mono_time, event.step
    raise RuntimeError(f"no step committed after the kill in {events_path}")


def step_interval(events_path: str, before: float) -> float:
    """The median time between consecutive committed steps before the kill: what a step costs with its
    snapshots (and neighbour copies), steps slowed alike in every case."""
    times = [e.mono_time for e in read_events(events_path) if isinstance(e, StepCompleted) and e.mono_time < before]
    return round(statistics.median(b - a for a, b in itertools.pairwise(times)), 4)


def final(run_dir: Path) -> Any:
    return DiskTier(run_dir / "final").latest(None).tree


def case_slices(root: Path, hidden: int, reference: Path) -> dict[str, Any]:
    run_dir = root / "slices"
    result = controller(run_dir, hidden, processes=4, slices=2, faults=[Fault("kill", 1, step=KILL_AT)]).run()
    killed = kill_time(result.events_path)
    at, step = first_commit_after(result.events_path, killed)
    recovery = result.recoveries[0]
    return {
        "ok": result.ok,
        "detected_s": round(result.detected_after_s[0], 3),
        "next_commit_s": round(at - killed, 3),
        "next_step": step,
        "lost_steps": recovery["lost_steps"],
        "restored_from": recovery["restored_from"],
        "bytes_by_tier": recovery["bytes_by_tier"],
        "survivor_restarts": result.survivor_restarts,
        **against(run_dir, reference),
    }


def against(run_dir: Path, reference: Path) -> dict[str, Any]:
    """The final parameters against the fault-free run's: bitwise, and the largest relative difference."""
    got, want = final(run_dir), final(reference)
    return {
        "bitwise": compare_states(got, want, bitwise=True)["match"],
        "max_rel_error": compare_states(got, want, bitwise=False)["max_rel_error"],
    }


def case_gcs(
    root: Path, hidden: int, gcs: str, reference: Path, *, full_restart: bool, neighbours: bool = False
) -> dict[str, Any]:
    name = "gcs_full_restart" if full_restart else "gcs_neighbours" if neighbours else "gcs_in_place"
    run_dir = root / name
    durable = f"{gcs}/{root.name}/{name}"  # a prefix of its own per repeat
    common = {
        "processes": 4,
        "slices": 1,
        "durable_dir": durable,
        "durable_every": EVERY,
        "neighbour_replicas": neighbours,
        "extra_env": {ENV_STEP_DELAY_S: "0.2"},
    }
    first = controller(
        run_dir,
        hidden,
        faults=[],
        replica_dir=str(root / f"{name}-replicas"),
        max_failures=0 if full_restart else 10,
        **common,
    )
    wipe_lost_replicas(first)
    kill_once_committed(first, KILL_AT - EVERY)
    try:
        result = first.run()
    except RecoveryError:  # the full restart's first run ends at the loss (max_failures=0), as planned
        if not full_restart:
            raise
        result = first.result
    killed = kill_time(result.events_path)
    interval = step_interval(result.events_path, killed)
    by_tier = result.recoveries[0]["bytes_by_tier"] if result.recoveries else {}
    events = result.events_path
    if full_restart:  # every process again, on "new hosts" (nothing local), from the newest durable step
        again = controller(
            run_dir, hidden, faults=[], resume=True, replica_dir=str(root / f"{name}-replicas-new"), **common
        )
        first_restore: dict[str, int] = {}

        async def note_restore(event: StepCompleted, ctx: Any) -> None:
            if not first_restore and event.duration_s > 0:  # the restarted group's restore, not a later one's
                first_restore.update(again.restored_bytes)

        again.bus.subscribe(StepCompleted, note_restore)
        result = again.run()
        by_tier = first_restore
        events = result.events_path
    at, step = first_commit_after(events, killed)
    return {
        "ok": result.ok,
        "next_commit_s": round(at - killed, 3),
        "next_step": step,
        "resumed_from": result.resumed_from if full_restart else None,
        "step_interval_s": interval,
        "bytes_by_tier": by_tier,
        **against(run_dir, reference),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=float, default=32.0, help="state size in MB (default 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    hidden = size_for(args.mb)
    state_bytes = 8 * (hidden * hidden + 2 * hidden)
    root = Path(tempfile.mkdtemp(prefix="bench-slices-"))
    print(
        f"state {state_bytes / 2**20:.1f} MB (features = hidden = {hidden}), {args.repeats} repeats, in {root}",
        file=sys.stderr,
    )
    runs: dict[str, list[dict[str, Any]]] = {
        "slices": [],
        "gcs_in_place": [],
        "gcs_neighbours": [],
        "gcs_full_restart": [],
    }
    started = time.time()
    with running_emulator("bench", root / "emulator.log") as emulator, contextlib.ExitStack():
        os.environ["STORAGE_EMULATOR_HOST"] = emulator.url  # the workers started here inherit it
        references = {}
        for slices in (2, 1):  # a fault-free run of each layout, for the bitwise check
            ref = root / f"reference-{slices}"
            assert controller(ref, hidden, processes=4, slices=slices, faults=[]).run().ok
            references[slices] = ref
        for repeat in range(args.repeats):
            for name in runs:
                scratch = root / f"r{repeat}"
                if name == "slices":
                    outcome = case_slices(scratch, hidden, references[2])
                else:
                    outcome = case_gcs(
                        scratch,
                        hidden,
                        "gs://bench",
                        references[1],
                        full_restart=name == "gcs_full_restart",
                        neighbours=name == "gcs_neighbours",
                    )
                runs[name].append(outcome)
                print(name, json.dumps(outcome), file=sys.stderr)
    medians = {name: statistics.median(r["next_commit_s"] for r in results) for name, results in runs.items()}
    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "state_mb": round(state_bytes / 2**20, 1),
        "minutes": round((time.time() - started) / 60, 1),
        "next_commit_s_median": medians,
        "full_restart_over_in_place": round(medians["gcs_full_restart"] / medians["gcs_in_place"], 2),
        "full_restart_over_neighbours": round(medians["gcs_full_restart"] / medians["gcs_neighbours"], 2),
        "runs": runs,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
