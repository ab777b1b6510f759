"""Sharded state across processes (issue 19): a lost process's shards from the other slice, or from GCS only
for that process, against a full restart of every process from GCS. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_slices.py [--mb 32] [--repeats 3] [--cases slices,gcs_in_place,...]
        [--json out.json]

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

For states of hundreds of MB on a small machine: ``--cases`` picks the cases (and only the fault-free runs
they need are made); each case's replica folders, final state and emulator objects are deleted once it is
measured; the controller's timeouts are wider than its defaults (:data:`TIMEOUTS`: false alarms only, since
the kill is seen as the process's exit); each phase prints a line on stderr with the memory available.
"""

from __future__ import annotations

import argparse
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

from elastic_runtime.cli.demo_multiprocess import group_controller, wipe_lost_replicas, worker_command
from elastic_runtime.cluster.protocol import ENV_STEP_DELAY_S
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.errors import RecoveryError
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import CheckpointCommitted, RunStarted, StateRestored, StepCompleted, WorkerKilled
from elastic_runtime.faults.grammar import Fault
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.gcs import make_client, parse_gs_uri
from elastic_runtime.testing.gcs_emulator import running_emulator

STEPS, KILL_AT, EVERY = 30, 15, 5
CASES = ("slices", "gcs_in_place", "gcs_neighbours", "gcs_full_restart")
# The controller's defaults suit small states. With hundreds of MB per process on 2 busy cores a restore from
# GCS plus the first step can outlast the 5 s hang timeout, and a re-forming group's survivors read several
# replica files before they join (20 s). The controller reads no message from the writer whose part completes
# a durable step while it commits that step (manifest and prune, 12.6 s once at 1 GB with the emulator busy),
# so that writer looks silent: hence 60 s without a heartbeat. None of these bounds the figures measured: the
# killed process is seen by its exit, not by a timeout.
TIMEOUTS = {
    "heartbeat_timeout_s": 60.0,
    "hang_timeout_s": 120.0,
    "form_timeout_s": 180.0,
    "spawn_timeout_s": 300.0,
    "start_timeout_s": 600.0,
}
_STARTED = time.monotonic()


def say(message: str) -> None:
    """A progress line on stderr: minutes since the start, memory available, load, ``message``."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) / 2**20
    elapsed = (time.monotonic() - _STARTED) / 60
    print(
        f"[{elapsed:5.1f} min, {available:.1f} GiB free, load {os.getloadavg()[0]:.1f}] {message}",
        file=sys.stderr,
        flush=True,
    )


def hard_deletes(bucket_name: str) -> None:
    """Deleted objects go at once: the emulator applies GCS's default soft-delete policy (7 days) and keeps
    what a prune deletes in its memory, a GB per checkpoint at 1 GB."""
    bucket = make_client().get_bucket(bucket_name)
    bucket.soft_delete_policy.retention_duration_seconds = 0
    bucket.patch()


def delete_prefix(uri: str) -> None:
    """Delete every object under ``gs://BUCKET/PREFIX`` (the emulator keeps them in memory)."""
    bucket_name, prefix = parse_gs_uri(uri)
    bucket = make_client().bucket(bucket_name)
    for blob in bucket.list_blobs(prefix=prefix + "/"):
        blob.delete()


def size_for(mb: float) -> int:
    """The features and hidden size (equal) giving about ``mb`` MB of state: parameters and momentum,
    2 x 4 x (F x H + 2 H) bytes. Square, so that the demo's learning rate stays stable."""
    return max(64, int((mb * 2**20 / 8) ** 0.5) // 64 * 64)


def controller(run_dir: Path, size: int, **kwargs: Any) -> Any:
    command = worker_command(STEPS, features=size, hidden=size)
    return group_controller(steps=STEPS, run_dir=run_dir, command=command, **(TIMEOUTS | kwargs))


def kill_once_committed(ctl: Any, step: int) -> None:
    """``kill -9`` of process 2 once durable step ``step`` (or a later one) is committed: GCS uploads to the
    emulator take a few steps, and the loss must find a durable step to go back to in both cases."""
    done = False

    async def kill(event: CheckpointCommitted, ctx: Any) -> None:
        nonlocal done
        if event.step is not None and event.step >= step and not done:
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
            assert event.step is not None  # a step's event names its step
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
    say("slices: the run, process 1 killed at step 15")
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
    root: Path,
    hidden: int,
    gcs: str,
    reference: Path,
    *,
    full_restart: bool,
    neighbours: bool = False,
    keep: int = 3,
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
        "durable_keep": keep,
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
    say(f"{name}: the run, process 2 killed once durable step {KILL_AT - EVERY} is committed")
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
                first_restore.update(again.supervisor.restore_tally.bytes_by_tier)

        again.bus.subscribe(StepCompleted, note_restore)
        say(f"{name}: every process started again, restoring from GCS")
        result = again.run()
        by_tier = first_restore
        events = result.events_path
    at, step = first_commit_after(events, killed)
    outcome = {
        "ok": result.ok,
        "next_commit_s": round(at - killed, 3),
        "next_step": step,
        "resumed_from": result.resumed_from if full_restart else None,
        "step_interval_s": interval,
        "bytes_by_tier": by_tier,
        **against(run_dir, reference),
    }
    delete_prefix(durable)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=float, default=32.0, help="state size in MB (default 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (all)")
    parser.add_argument(
        "--durable-keep",
        type=int,
        default=3,
        help="durable checkpoints kept in GCS (default 3; the emulator holds them in memory)",
    )
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--logs", default=None, help="keep each case's event log and worker logs in this folder")
    args = parser.parse_args()
    cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    if not cases or not set(cases) <= set(CASES):
        parser.error(f"--cases takes some of {', '.join(CASES)}, got {args.cases!r}")
    hidden = size_for(args.mb)
    state_bytes = 8 * (hidden * hidden + 2 * hidden)
    root = Path(tempfile.mkdtemp(prefix="bench-slices-"))
    say(
        f"state {state_bytes / 2**20:.1f} MB (features = hidden = {hidden}), {args.repeats} repeats of "
        f"{', '.join(cases)}, in {root}"
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    layouts = sorted({2 if name == "slices" else 1 for name in cases}, reverse=True)
    started = time.time()
    try:
        with running_emulator("bench", root / "emulator.log") as emulator:
            os.environ["STORAGE_EMULATOR_HOST"] = emulator.url  # the workers started here inherit it
            hard_deletes("bench")
            references = {}
            for slices in layouts:  # a fault-free run of each layout needed, for the bitwise check
                ref = root / f"reference-{slices}"
                say(f"reference: a fault-free run, {slices} slice(s)")
                assert controller(ref, hidden, processes=4, slices=slices, faults=[]).run().ok
                references[slices] = ref
            for repeat in range(args.repeats):
                scratch = root / f"r{repeat}"
                for name in runs:
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
                            keep=args.durable_keep,
                        )
                    runs[name].append(outcome)
                    if args.logs:
                        skip = shutil.ignore_patterns("final", "*replicas*")
                        shutil.copytree(scratch, Path(args.logs) / f"r{repeat}-{name}", ignore=skip)
                    shutil.rmtree(scratch, ignore_errors=True)  # its replica files and final state
                    say(f"{name} (repeat {repeat + 1}): {json.dumps(outcome)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: statistics.median(r["next_commit_s"] for r in results) for name, results in runs.items()}
    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "state_mb": round(state_bytes / 2**20, 1),
        "durable_keep": args.durable_keep,
        "minutes": round((time.time() - started) / 60, 1),
        "next_commit_s_median": medians,
        "runs": runs,
    }
    for in_place in ("gcs_in_place", "gcs_neighbours"):
        if {in_place, "gcs_full_restart"} <= set(medians):
            ratio = round(medians["gcs_full_restart"] / medians[in_place], 2)
            summary[f"full_restart_over_{in_place.removeprefix('gcs_')}"] = ratio
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
