"""Recovery at the speed of the wire (issue 64): a lost worker's shards refilled over shaped links. Not collected
by pytest; needs root (each simulated host is a network namespace, each link shaped with ``tc``).

    sudo .venv/bin/python tests/benchmarks/bench_wire.py --mb 256 --link-gbit 1 [--repeats 1] [--json]

4 workers on 4 simulated hosts (:class:`~elastic_runtime.testing.hosts.SimulatedHosts`), 2 slices of 2 processes
(``controller --slices 2``: each slice holds the whole state, sharded over its 2 processes); every host's link
limited to ``--link-gbit`` each way (``tc tbf``). After ``--kill-at`` steps every process on host 1 is killed
(``kill -9``). Two cases per repeat, their order alternating:

- ``replace``: a warm spare waits on a fifth host; it takes the lost seat and receives its shards from the other
  slice over the wire, the survivors go on in their processes;
- ``full_restart``: what a job without in-process recovery does: the controller stops at the loss
  (``--max-failures 0``) and every worker with it; a new controller (``--resume``) and 4 new workers start, host
  1's on the fifth host; each survivor's host reads its replica files from its disk (a folder per host), the new
  one's shards come from the other slice over the wire.

The demo model at about ``--mb`` MB of state (parameters and momentum), steps not slowed.

The last line is JSON, per run:

- ``lost_bytes``: the lost process's shards (what its replacement must receive);
- ``link_bytes_per_s``: the links' rate; ``detect_s``: the kill to the controller's ``WorkerLost``;
- ``transfer_s``: the slowest member's part in the restore's collective (the controller's ``RecoveryCompleted``),
  ``wire_share``: lost_bytes / transfer_s as a share of the link's rate;
- ``kill_to_commit_s``: the kill to the first step committed after the restore (every process shares this
  machine's monotonic clock); ``bound_s``: detection + lost_bytes / link + 2 steps + 1 s, the issue's bound;
- ``step_s``: the median step before the kill; ``bytes_by_tier``: what each tier gave (the workers' reports);
- ``bitwise``: the final state against a fault-free run of the same layout on loopback.

The full restart reads the survivors' shards from their hosts' disks, not from a durable tier across the wire
(issue 64 asks for the latter too: not here yet).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_slices: the state's size

from bench_slices import TIMEOUTS as REFERENCE_TIMEOUTS  # noqa: E402
from bench_slices import size_for  # noqa: E402

from elastic_runtime.cli.demo_hosts import HostedRun  # noqa: E402
from elastic_runtime.cli.demo_multiprocess import run_group, worker_command  # noqa: E402
from elastic_runtime.core.compare import compare_states  # noqa: E402
from elastic_runtime.core.eventlog import read_events  # noqa: E402
from elastic_runtime.core.events import GroupFormed, RecoveryCompleted, StepCompleted, WorkerLost  # noqa: E402
from elastic_runtime.storage.disk import DiskTier  # noqa: E402
from elastic_runtime.testing.demo_model import init_state  # noqa: E402
from elastic_runtime.testing.hosts import SimulatedHosts  # noqa: E402

WORKERS, SLICES, LOST = 4, 2, 1
# Wide enough for hundreds of MB a process on 2 busy cores (see bench_slices.TIMEOUTS); the kill is seen as the
# worker's connection closing, not by a timeout.
TIMEOUTS = ["--heartbeat-timeout", "60", "--hang-timeout", "120", "--form-timeout", "180", "--start-timeout", "600"]


def say(message: str) -> None:
    print(f"[load {os.getloadavg()[0]:.1f}] {message}", file=sys.stderr, flush=True)


def one_run(
    root: Path, *, size: int, steps: int, kill_at: int, link_bits_per_s: float, full_restart: bool
) -> dict[str, Any]:
    run_dir = root / f"{'restart' if full_restart else 'replace'}-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    command = worker_command(steps, features=size, hidden=size)
    slices = ["--slices", str(SLICES), *TIMEOUTS]
    # A full restart keeps each host's replica files on disk (a folder per host): /dev/shm goes with its processes.
    disk = run_dir / "disk" if full_restart else None
    with SimulatedHosts(WORKERS + 1) as hosts:
        for k in range(WORKERS + 1):
            hosts.shape(k, link_bits_per_s)
        run = HostedRun(hosts, run_dir, steps=steps, nprocs=WORKERS, faulty=False, command=command, disk=disk)
        try:
            run.start(step_delay_s=0.0, controller_args=[*slices, *(["--max-failures", "0"] if full_restart else [])])
            run.wait_for("the first group", lambda: run.formed(1))
            if not full_restart:
                run.start_worker(WORKERS, WORKERS)  # the warm spare, on the fifth host
            run.wait_for(f"step {kill_at}", lambda: run.committed(kill_at))
            killed = time.monotonic()  # the events' mono_time is the same clock
            hosts.kill(LOST)
            say(f"host {LOST}'s worker killed after step {kill_at}")
            if full_restart:  # the controller stops every worker; all start again, host 1's share on host 4
                run.wait_for_exit("the controller's stop at the loss")
                run.wait_for_hosts_idle([k for k in range(WORKERS) if k != LOST])
                run = HostedRun(hosts, run_dir, steps=steps, nprocs=WORKERS, faulty=False, command=command, disk=disk)
                seats = [WORKERS if k == LOST else k for k in range(WORKERS)]
                run.start(step_delay_s=0.0, controller_args=[*slices, "--resume"], hosts=seats)
            result = run.finish()
        finally:
            run.stop()
    events = read_events(run.events_path)
    return measure(result, events, killed, link_bits_per_s, size) | {"run_dir": str(run_dir)}


def measure(
    result: dict[str, Any], events: list[Any], killed: float, link_bits_per_s: float, size: int
) -> dict[str, Any]:
    lost = [e for e in events if isinstance(e, WorkerLost) and e.mono_time >= killed]
    done = [e for e in events if isinstance(e, RecoveryCompleted)]
    steps = [e for e in events if isinstance(e, StepCompleted) and e.step is not None]
    before = [e.mono_time for e in steps if e.mono_time < killed]
    formed = [e for e in events if isinstance(e, GroupFormed) and e.mono_time > killed]
    restored = formed[0].restore_step if formed else -1
    after = [e.mono_time for e in steps if e.mono_time > killed and (e.step or 0) > restored]
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(init_state(size, size)))
    lost_bytes = whole // (WORKERS // SLICES)  # a process holds its slice's share (the w1 split over "model")
    link = link_bits_per_s / 8
    step_s = statistics.median(b - a for a, b in itertools.pairwise(before)) if len(before) > 2 else None
    detect_s = lost[0].mono_time - killed if lost else None
    transfer_s = done[0].transfer_s if done else None
    out: dict[str, Any] = {
        "ok": bool(result.get("ok")),
        "lost_bytes": lost_bytes,
        "link_bytes_per_s": link,
        "detect_s": _round(detect_s),
        "transfer_s": transfer_s,
        "wire_share": round(lost_bytes / transfer_s / link, 3) if transfer_s else None,
        "kill_to_commit_s": _round(after[0] - killed if after else None),
        "step_s": _round(step_s),
        "bytes_by_tier": done[0].bytes_by_tier if done else {},
        "read_s_by_tier": done[0].read_s_by_tier if done else {},
        "groups": [sorted(e.members) for e in events if isinstance(e, GroupFormed)],
    }
    if detect_s is not None and step_s is not None:
        out["bound_s"] = round(detect_s + lost_bytes / link + 2 * step_s + 1.0, 3)
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def reference(root: Path, *, size: int, steps: int) -> Path:
    """A fault-free run of the same layout on loopback: its final state's folder."""
    run_dir = root / "reference"
    command = worker_command(steps, features=size, hidden=size)
    done = run_group(
        processes=WORKERS, slices=SLICES, steps=steps, run_dir=run_dir, faults=[], command=command, **REFERENCE_TIMEOUTS
    )
    if not done.ok:
        raise SystemExit(f"the fault-free reference failed: {done.reason}")
    return run_dir / "final"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=float, default=256.0, help="state size in MB (default 256)")
    parser.add_argument("--link-gbit", type=float, default=1.0, help="each host's link, Gbit/s each way (default 1)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--cases", default="replace,full_restart", help="comma-separated: replace, full_restart")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root: each simulated host is a network namespace")
    size = size_for(args.mb)
    root = Path(tempfile.mkdtemp(prefix="bench-wire-"))
    say(f"state {2 * 4 * (size * size + 2 * size) / 1e6:.1f} MB (features = hidden = {size}), in {root}")
    want = DiskTier(reference(root, size=size, steps=args.steps)).latest(None).tree
    runs: dict[str, list[dict[str, Any]]] = {"replace": [], "full_restart": []}
    for repeat in range(args.repeats):
        order = [case for case in runs if case in args.cases.split(",")]
        for case in order if repeat % 2 == 0 else order[::-1]:  # a shared machine: alternate
            say(f"run {repeat + 1} of {args.repeats}, {case}: links at {args.link_gbit:g} Gbit/s")
            outcome = one_run(
                root,
                size=size,
                steps=args.steps,
                kill_at=args.kill_at,
                link_bits_per_s=args.link_gbit * 1e9,
                full_restart=case == "full_restart",
            )
            final = Path(outcome["run_dir"]) / "final"
            got = DiskTier(final).latest(None).tree if final.exists() else None
            outcome["bitwise"] = got is not None and compare_states(got, want, bitwise=True)["match"]
            say(json.dumps(outcome))
            runs[case].append(outcome)
    medians = {
        case: statistics.median(r["kill_to_commit_s"] for r in done if r["kill_to_commit_s"] is not None)
        for case, done in runs.items()
        if any(r["kill_to_commit_s"] is not None for r in done)
    }
    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "state_mb": round(2 * 4 * (size * size + 2 * size) / 1e6, 1),
        "link_gbit": args.link_gbit,
        "kill_to_commit_s_median": medians,
        "runs": runs,
    }
    if len(medians) == 2:
        summary["full_restart_over_replace"] = round(medians["full_restart"] / medians["replace"], 2)
    if args.json:
        print(json.dumps(summary))
    else:
        print(json.dumps(summary, indent=1))
    return 0 if all(r["ok"] and r["bitwise"] for done in runs.values() for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
