"""``elastic-runtime demo --processes N --kill-worker-at STEP``: the multi-process demonstration.

A controller starts N worker processes (2 CPU devices each, gloo collectives on loopback) and one warm spare;
at ``STEP`` one worker gets a real ``kill -9``. The controller notices, re-forms the group in-process with the
spare in the dead worker's place, restores the newest committed step from host memory (the spare gets it
from its peers), and training carries on; the controller is never restarted. With ``--json`` the last line
is a summary; ``--verify`` runs the same job fault-free and compares the final parameters bitwise.

This module is also the workers' script: ``python -m elastic_runtime.cli.demo_multiprocess --worker --steps N``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# A smaller model than the single-process demo: every worker holds all of it (see storage/replicas.py).
FEATURES = 128
HIDDEN = 512
GLOBAL_BATCH = 96  # divides over 1, 2, 3, 4 and 6 processes


def add_multiprocess_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's multi-process options (added to ``elastic-runtime demo``)."""
    group = parser.add_argument_group("multi-process")
    group.add_argument("--processes", type=int, default=0, help="run as N worker processes (0: single-process)")
    group.add_argument("--slices", type=int, default=0, help="slices of processes (default: one per process)")
    group.add_argument("--kill-worker-at", type=int, default=None, help="kill -9 a worker at this step")
    group.add_argument("--kill-process", type=int, default=1, help="process id to kill (default 1; 0 works too)")
    group.add_argument("--strategy", choices=("reform", "restart"), default="reform", help="recovery strategy")
    group.add_argument(
        "--slow-worker",
        default=None,
        metavar="P:FACTOR@STEP",
        help="process P becomes a straggler from STEP: each iteration FACTOR times its own work (e.g. 2:3@20)",
    )
    group.add_argument(
        "--corrupt-worker-at",
        default=None,
        metavar="P:STEP",
        help="silent data corruption in process P: a bit of its copy of the state flipped after STEP (with "
        "--persistent: from then on); the slices' copies are compared after every step (--slices 2 or more)",
    )
    group.add_argument(
        "--durable", default=None, metavar="DIR|gs://B/P", help="durable checkpoints of the sharded state (a folder)"
    )
    group.add_argument("--gcs", action="store_true", help="durable checkpoints in GCS (the emulator, started here)")
    group.add_argument("--durable-every", type=int, default=10, help="steps between durable checkpoints")
    group.add_argument(
        "--neighbour-replicas",
        action="store_true",
        help="each process also keeps the previous process's shards in RAM (slices of 2 processes or more)",
    )
    group.add_argument(
        "--wipe-lost", action="store_true", help="delete the killed worker's replica files (its host's /dev/shm)"
    )


def worker_command(
    steps: int, *, features: int = FEATURES, hidden: int = HIDDEN, fingerprint: bool = False
) -> list[str]:
    """The workers' command line: this module's :func:`worker_main` (the model's size for benchmarks;
    ``fingerprint``: the slices compared after every step)."""
    size = [] if (features, hidden) == (FEATURES, HIDDEN) else ["--features", str(features), "--hidden", str(hidden)]
    flags = ["--fingerprint"] if fingerprint else []
    command = [sys.executable, "-m", "elastic_runtime.cli.demo_multiprocess", "--worker", "--steps", str(steps)]
    return [*command, *size, *flags]


def group_controller(
    *,
    processes: int,
    steps: int,
    run_dir: Path,
    faults: list[Any],
    strategy: str = "reform",
    printer: Any = None,
    command: list[str] | None = None,
    **extra: Any,
) -> Any:
    """The controller of the demo job (or ``command``) as a launched group, not started yet."""
    from elastic_runtime.cluster.config import LaunchConfig, Strategy
    from elastic_runtime.core.events import Event
    from elastic_runtime.defaults import default_controller

    # The final state written where the demo's check reads it (``extra`` may say otherwise).
    settings: dict[str, Any] = {"target_steps": steps, "result_path": str(run_dir / "final")} | extra
    config = LaunchConfig(
        command=command or worker_command(steps),
        nprocs=processes,
        run_dir=str(run_dir),
        faults=faults,
        strategy=Strategy(strategy),
        progress=False,  # the demo prints its own (``printer``)
        **settings,
    )
    controller = default_controller(config)
    if printer is not None:
        controller.bus.subscribe(Event, printer, priority=-100)
    return controller


def run_group(**kwargs: Any) -> Any:
    """Run the demo job (or ``command``) as a launched group; returns the controller's LaunchResult.

    Takes the keywords of :func:`group_controller`.
    """
    return group_controller(**kwargs).run()


def run_multiprocess_demo(args: argparse.Namespace) -> int:
    """The ``demo --processes N`` entry point."""
    from elastic_runtime.cli.progress import ProgressPrinter
    from elastic_runtime.cluster.protocol import ENV_STEP_DELAY_S
    from elastic_runtime.core.compare import compare_states
    from elastic_runtime.core.errors import ConfigError
    from elastic_runtime.core.eventlog import read_events
    from elastic_runtime.faults.grammar import Fault, parse_faults
    from elastic_runtime.storage.disk import DiskTier
    from elastic_runtime.testing.gcs_emulator import running_emulator

    steps = args.steps
    kill_at = args.kill_worker_at
    run_dir = Path(args.run_dir or f"runs/demo-mp-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if args.quiet else print
    slices = args.slices or args.processes
    say(
        f"elastic-runtime demo: {steps} steps on {args.processes} worker processes x 2 CPU devices (gloo), "
        f"{slices} slice(s) of {args.processes // slices} process(es)"
    )
    faults = [] if kill_at is None or args.no_fault else [Fault("kill", args.kill_process, step=kill_at)]
    if faults:
        say(f"  process {args.kill_process} gets kill -9 at step {kill_at}; strategy {args.strategy}")
    slow = None
    if args.slow_worker and not args.no_fault:
        try:
            process, _, rest = args.slow_worker.partition(":")
            factor, _, at = rest.partition("@")
            (slow,) = parse_faults(f"slow:{process}@{at}x{factor}", kinds=("worker",))
        except ValueError as exc:
            print(f"error: --slow-worker {args.slow_worker!r}: {exc}; expected P:FACTOR@STEP (2:3@20)", file=sys.stderr)
            return 2
        faults.append(slow)
        say(f"  process {slow.target} becomes {slow.factor:g}x slower from step {slow.step}")
    corrupt = None
    if args.corrupt_worker_at and not args.no_fault:
        action = "corrupt-persistent" if args.persistent else "corrupt"
        try:
            process, _, at = args.corrupt_worker_at.partition(":")
            (corrupt,) = parse_faults(f"{action}:{process}@{at}", kinds=("worker",))
        except ValueError as exc:
            given = args.corrupt_worker_at
            print(f"error: --corrupt-worker-at {given!r}: {exc}; expected P:STEP (1:12)", file=sys.stderr)
            return 2
        faults.append(corrupt)
        how = "from then on" if args.persistent else "once"
        where = f"process {corrupt.target}'s copy flipped after step {corrupt.step}"
        say(f"  silent data corruption: a bit of {where}, {how}")
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        durable = args.durable
        if args.gcs:
            emulator = stack.enter_context(running_emulator("demo", run_dir / "gcs-emulator.log"))
            stack.enter_context(_environment("STORAGE_EMULATOR_HOST", emulator.url))
            durable = "gs://demo/run"
        if durable:
            say(f"  durable checkpoints every {args.durable_every} steps in {durable}")
        if args.step_delay:  # the workers read it at their start, the reference run's too
            stack.enter_context(_environment(ENV_STEP_DELAY_S, str(args.step_delay)))
        try:
            controller = group_controller(
                processes=args.processes,
                steps=steps,
                run_dir=run_dir / "run",
                faults=faults,
                strategy=args.strategy,
                printer=None if args.quiet else ProgressPrinter(),
                command=worker_command(steps, fingerprint=True) if corrupt is not None else None,
                slices=args.slices,
                durable_dir=durable,
                durable_every=args.durable_every,
                neighbour_replicas=args.neighbour_replicas,
            )
        except ConfigError as exc:  # a bad value on the command line: the message names the setting
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.wipe_lost:
            wipe_lost_replicas(controller)
        result = controller.run()
    recoveries = result.recoveries
    summary: dict[str, Any] = {
        "ok": result.ok,
        "processes": args.processes,
        "slices": args.slices or args.processes,
        "steps_completed": result.step,
        "seconds": round(time.monotonic() - started, 3),
        "detected_after_s": _first(result.detected_after_s),
        "recovery_s": _first([r["recovery_s"] for r in recoveries]),
        "lost_steps": sum(r["lost_steps"] for r in recoveries),
        "restored_from": _first([r["restored_from"] for r in recoveries]),
        "bytes_by_tier": _first([r["bytes_by_tier"] for r in recoveries]),
        "strategy": _first([r["strategy"] for r in recoveries]),
        "recoveries": len(recoveries),
        "survivor_restarts": result.survivor_restarts,
        "world_size_history": result.world_size_history,
        "run_dir": str(run_dir),
    }
    if slow is not None:
        summary["straggler"] = straggler_summary(read_events(run_dir / "run" / "events.jsonl"), slow)
    if corrupt is not None:
        from elastic_runtime.analysis.summary import corruption_summary

        assert corrupt.step is not None
        summary["corruption"] = corruption_summary(read_events(run_dir / "run" / "events.jsonl"), corrupt.step)
    if args.verify:
        say("verifying: fault-free run of the same group ...")
        with _environment(ENV_STEP_DELAY_S, str(args.step_delay or 0.0)):
            reference = run_group(
                processes=args.processes,
                steps=steps,
                run_dir=run_dir / "reference",
                faults=[],
                slices=args.slices,
            )
        full = all(size == args.processes for size in result.world_size_history)
        if reference.ok and full:
            got, want = (DiskTier(run_dir / name / "final").latest(None).tree for name in ("run", "reference"))
            summary["reference_match"] = compare_states(got, want, bitwise=True)
        else:
            summary["reference_match"] = {"match": False}
    if summary["recoveries"]:
        outcome = (
            f"detected after {summary['detected_after_s']} s, recovered in {summary['recovery_s']} s "
            f"({summary['strategy']}, from {summary['restored_from']}), lost {summary['lost_steps']} step(s), "
            f"survivor restarts {summary['survivor_restarts']}"
        )
    else:
        outcome = "no recovery"
    if corrupt is not None:
        found = summary["corruption"]
        outcome += (
            f"; silent data corruption found at step {found['detected_step']}, healed ({found['kind']}) in "
            f"{found['healed_s']} s, evicted {found['evicted'] or 'nothing'}"
        )
    say(f"\nfinished {summary['steps_completed']} steps in {summary['seconds']:.2f} s; {outcome}")
    if "reference_match" in summary:
        say(f"reference check: {summary['reference_match']}")
    if args.json:
        print(json.dumps(summary))
    return 0 if result.ok and summary.get("reference_match", {}).get("match", True) else 1


def straggler_summary(events: list[Any], slow: Any) -> dict[str, Any]:
    """What the controller made of the straggler ``slow`` (a ``slow`` fault): its first ``Straggler`` event (the
    step it was found at, the action and why), and the group's median step time before the slowdown, while it
    lasted and after the group re-formed without it (``step_time_ratio_after``: after / before)."""
    from elastic_runtime.core.events import GroupFormed, StepCompleted, Straggler

    found = next((e for e in events if isinstance(e, Straggler)), None)
    at = {e.step: e.mono_time for e in events if isinstance(e, StepCompleted) and e.step is not None}
    last = max(at, default=0)
    formed = next((e for e in events if isinstance(e, GroupFormed) and found and e.mono_time > found.mono_time), None)

    def median_step(first: int, until: int) -> float | None:
        gaps = [at[s] - at[s - 1] for s in range(first + 1, until + 1) if s in at and s - 1 in at]
        return round(statistics.median(gaps), 4) if gaps else None

    before = median_step(max(slow.step - 10, 1), slow.step)
    during = median_step(slow.step + 1, found.step if found and found.step is not None else last)
    after = median_step(formed.restore_step + 2, last) if formed else None
    return {
        "process": slow.target,
        "factor": slow.factor,
        "from_step": slow.step,
        "detected_step": found.step if found else None,
        "worker": found.worker if found else None,
        "slowdown": round(found.slowdown, 3) if found else None,
        "action": found.action if found else None,
        "reason": found.reason if found else "not found",
        "step_time_before_s": before,
        "step_time_during_s": during,
        "step_time_after_s": after,
        "step_time_ratio_after": round(after / before, 3) if after and before else None,
    }


def wipe_lost_replicas(controller: Any) -> None:
    """A lost worker's replica files go with it (its host's ``/dev/shm``): its shards must come from elsewhere.

    The folder leaves the replica folder at once (a rename) and is deleted in a thread: deleted in the handler,
    it held the controller's event loop, and so the re-forming, while the files went (0.5 s for 1.6 GB on a
    VM's disk), a delay a lost host does not cost the survivors.
    """
    from elastic_runtime.core.events import WorkerExited, WorkerLost

    async def wipe(event: WorkerExited | WorkerLost, ctx: Any) -> None:
        if isinstance(event, WorkerExited) and event.returncode == 0:
            return
        folder = Path(controller.replica_dir) / f"worker-{event.worker}"
        if not folder.is_dir():
            return  # wiped already: both events come
        holder = Path(tempfile.mkdtemp(prefix=f"{folder.parent.name}-lost-", dir=folder.parent.parent))
        folder.rename(holder / folder.name)
        threading.Thread(target=shutil.rmtree, args=(holder,), kwargs={"ignore_errors": True}).start()

    # Before the regroup handler (priority 0) asks for the group that will look for the files.
    controller.bus.subscribe(WorkerExited, wipe, priority=100)
    controller.bus.subscribe(WorkerLost, wipe, priority=100)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    previous = os.environ.get(name)
    os.environ[name] = value  # the workers this process starts inherit it
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _first(values: list[Any]) -> Any:
    return round(values[0], 3) if values and isinstance(values[0], float) else (values[0] if values else None)


def worker_main(argv: list[str] | None = None) -> None:
    """The workers' script."""
    from elastic_runtime.cluster.worker import run_worker
    from elastic_runtime.defaults import watch_own_host
    from elastic_runtime.testing.demo_model import demo_job

    parser = argparse.ArgumentParser(prog="python -m elastic_runtime.cli.demo_multiprocess")
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--features", type=int, default=FEATURES)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--fingerprint", action="store_true", help="compare the slices after every step")
    args = parser.parse_args(argv)
    job = demo_job(global_batch=GLOBAL_BATCH, features=args.features, hidden=args.hidden)
    run_worker(job, steps=args.steps, watch_notices=watch_own_host, fingerprint_every=1 if args.fingerprint else 0)


if __name__ == "__main__":
    worker_main()
