"""Recovery of a real model under ``launch --nprocs 4 --slices 2``: a worker killed with ``kill -9`` after
warm-up, the group re-formed with its compiled programs loaded (the default), traced and compiled again
(``ELASTIC_KEEP_PROGRAMS=0``: what every re-forming did before), and every worker restarted (``--strategy
restart``: new processes, the state from the replica files, everything compiled anew), interleaved. Not
collected by pytest.

    .venv/bin/python tests/benchmarks/bench_real_recovery.py [--models keyed flax] [--repeats 3] [--json]

Models: ``keyed``, the small job shaped like MaxText's (runtime/testing/keyed_model.py: typed keys, its own mesh
axes, a step built per mesh); ``flax``, examples/flax_lm.py's 2-layer transformer; ``maxtext``,
examples/maxtext_lm.py (only where ``maxtext`` imports: ``make maxtext``'s environment). Per run: the recovery
(kill to the next committed step at full size), the phases ``report`` splits it into, and how many programs the
re-formed group traced. The last line is JSON with the medians and the ratios.

    .venv/bin/python tests/benchmarks/bench_real_recovery.py --smaller [--models keyed flax] [--repeats 3] [--json]
        [--variants prepared unprepared]

``--smaller`` instead: ``--min-nprocs 2``, no spare (and none started within the spawn timeout), so a lost slice
leaves the group one slice smaller; process 1 killed once step ``--kill-at`` is committed and, by default, every
worker said its programs of that layout are kept (``LikelyMeshesReady``; runtime/cluster/worker/smaller.py);
against ``ELASTIC_PREPARE_SMALLER=0`` (the smaller group traces and compiles them when it forms), interleaved. Per
run: kill to the next commit (one slice smaller), its phases, the programs the smaller group traced, and when the
last worker had the smaller layout's programs kept (from the group's forming).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_runtime.analysis.goodput import goodput
from elastic_runtime.cli.demo_multiprocess import group_controller, wipe_lost_replicas
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupFormed, LikelyMeshesReady, StepCompleted
from elastic_runtime.faults.grammar import Fault

ROOT = Path(__file__).resolve().parents[2]
MODES = {  # name -> (strategy, environment)
    "kept": ("reform", {}),
    "traced": ("reform", {"ELASTIC_KEEP_PROGRAMS": "0"}),
    "restart": ("restart", {}),
}
# --durable: one slice (no other slice holds the lost shards), durable checkpoints every 5 steps, the killed
# worker's replica files deleted with it: its quarter of the state comes from the durable tier.
DURABLE = {"slices": 1, "durable_every": 5}


def command(model: str, steps: int, run_dir: Path) -> list[str]:
    if model == "keyed":
        return [sys.executable, str(ROOT / "tests/multiprocess/keyed_train.py"), "--steps", str(steps)]
    script = {"flax": "examples/flax_lm.py", "maxtext": "examples/maxtext_lm.py"}[model]
    # The example's run folder is the launch's: a script naming another one is refused under launch.
    flags = ["--steps", str(steps), "--lose-slice-at", "0", "--no-reference", "--run-dir", str(run_dir)]
    return [sys.executable, str(ROOT / script), *flags]


def one(
    model: str, mode: str, *, steps: int, kill_at: int | None, hang_timeout_s: float, durable: bool = False
) -> dict[str, Any]:
    strategy, env = MODES[mode]
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-real-{model}-{mode}-"))
    layout: dict[str, Any] = {"slices": 2}
    if durable:
        layout = DURABLE | {"durable_dir": str(run_dir / "durable")}
    controller = group_controller(
        processes=4,
        steps=steps,
        run_dir=run_dir,
        faults=[] if kill_at is None else [Fault("kill", 1, step=kill_at)],
        strategy=strategy,
        command=command(model, steps, run_dir),
        replica_dir=str(run_dir / "replicas"),
        extra_env=env,
        start_timeout_s=600.0,
        spawn_timeout_s=600.0,  # MaxText's imports alone took over 60 s at load 20
        form_timeout_s=300.0,
        hang_timeout_s=hang_timeout_s,
        **layout,
    )
    if durable and kill_at is not None:
        wipe_lost_replicas(controller)
    result = controller.run()
    events = read_events(run_dir / "events.jsonl")
    report = goodput(events)
    failure = report.failures[0] if report.failures else None
    formed = [e for e in events if isinstance(e, GroupFormed)]
    return {
        "model": model,
        "mode": mode,
        "ok": result.ok,
        "recovery_s": failure.recovery_s if failure else None,
        "phases": failure.phases if failure else {},
        # report's split of the recovery: its parts should add up to recovery_s
        "phases_sum_s": round(sum(failure.phases.values()), 3) if failure else None,
        "traced_at_reform": sum(f.traced for f in formed[1:]),
        "first_forming_s": report.badput_s.get("PROGRAM_STARTUP", 0.0),
        "restored_from": result.recoveries[0]["restored_from"] if result.recoveries else None,
        "bytes_by_tier": result.recoveries[0]["bytes_by_tier"] if result.recoveries else {},
        "digest": next(iter(result.digests.values()), ""),
        "run_dir": str(run_dir),
    }


def one_smaller(model: str, prepared: bool, *, steps: int, kill_at: int, hang_timeout_s: float) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-smaller-{model}-"))
    controller = group_controller(
        processes=4,
        slices=2,
        min_nprocs=2,
        spares=0,
        fork_spares=False,
        spawn_timeout_s=0.3,
        steps=steps,
        run_dir=run_dir,
        faults=[],
        command=command(model, steps, run_dir),
        replica_dir=str(run_dir / "replicas"),
        extra_env={} if prepared else {"ELASTIC_PREPARE_SMALLER": "0"},
        start_timeout_s=600.0,
        form_timeout_s=300.0,
        hang_timeout_s=hang_timeout_s,
    )
    ready: set[str] = set()
    killed: list[int] = []

    async def kill(event: StepCompleted | LikelyMeshesReady, ctx: Any) -> None:
        if isinstance(event, LikelyMeshesReady):
            ready.add(event.source)
        due = (event.step or 0) >= kill_at and (len(ready) == 4 or not prepared)
        if due and not killed and len(ctx.members) == 4:
            killed.append(event.step or 0)
            ctx.signal(ctx.members[1], "KILL", "benchmark: a slice lost")

    controller.bus.subscribe(StepCompleted, kill)
    controller.bus.subscribe(LikelyMeshesReady, kill)
    result = controller.run()
    events = read_events(run_dir / "events.jsonl")
    failure = next(iter(goodput(events).failures), None)
    formed = [e for e in events if isinstance(e, GroupFormed)]
    prepared_at = [e.mono_time for e in events if isinstance(e, LikelyMeshesReady)]
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "model": model,
        "mode": "prepared" if prepared else "unprepared",
        "ok": result.ok,
        "killed_at_step": killed[0] if killed else None,
        "recovery_s": failure.recovery_s if failure else None,
        "phases": failure.phases if failure else {},
        "traced_at_shrink": formed[1].traced if len(formed) > 1 else None,
        "world_sizes": result.world_size_history,
        # from the first group's forming to the last worker's LikelyMeshesReady
        "prepared_after_s": round(max(prepared_at) - formed[0].mono_time, 2) if prepared_at else None,
    }


def interleaved(
    args: argparse.Namespace, modes: list[str], run: Callable[[str, str], dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, dict[str, float | None]]]:
    """``run(model, mode)`` for each model and mode, ``args.repeats`` times, interleaved (the machine's load shifts
    between repeats, not between modes): the runs, and each model's median recovery in each mode."""
    runs = []
    for _ in range(args.repeats):
        for model in args.models:
            for mode in modes:
                runs.append(result := run(model, mode))
                if not args.json:
                    print(json.dumps(result), flush=True)
    medians: dict[str, dict[str, float | None]] = {}
    for model in args.models:
        medians[model] = {}
        for mode in modes:
            times = [r["recovery_s"] for r in runs if (r["model"], r["mode"]) == (model, mode) and r["recovery_s"]]
            medians[model][mode] = round(statistics.median(times), 3) if times else None
    return runs, medians


def smaller(args: argparse.Namespace) -> None:
    def run(model: str, mode: str) -> dict[str, Any]:
        kw = {"steps": args.steps, "kill_at": args.kill_at, "hang_timeout_s": args.hang_timeout}
        return one_smaller(model, mode == "prepared", **kw)

    runs, medians = interleaved(args, args.variants, run)
    summary: dict[str, Any] = {"load_average": os.getloadavg(), "repeats": args.repeats}
    for model, times in medians.items():
        traced = {m: [r["traced_at_shrink"] for r in runs if (r["model"], r["mode"]) == (model, m)] for m in times}
        summary[model] = {"recovery_s": times, "traced_at_shrink": traced}
        prepared, unprepared = times.get("prepared"), times.get("unprepared")
        if prepared and unprepared:
            summary[model]["unprepared_over_prepared"] = round(unprepared / prepared, 2)
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["keyed", "flax"], choices=["keyed", "flax", "maxtext"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument(
        "--hang-timeout", type=float, default=60.0, help="a real model's first step on a loaded CPU takes seconds"
    )
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    parser.add_argument(
        "--durable", action="store_true", help="instead: one slice, the lost shards from the durable tier, once each"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="with --durable: exit 1 unless each run ended ok, bitwise equal to the fault-free run, with at most "
        "about the lost worker's share of the state read from the durable tier (make maxtext-launch, in CI)",
    )
    parser.add_argument("--smaller", action="store_true", help="instead: a group left one slice smaller (above)")
    parser.add_argument("--variants", nargs="+", default=["prepared", "unprepared"], choices=["prepared", "unprepared"])
    args = parser.parse_args()
    if args.smaller:
        smaller(args)
        return
    if args.durable:
        durable(args)
        return

    def run(model: str, mode: str) -> dict[str, Any]:
        return one(model, mode, steps=args.steps, kill_at=args.kill_at, hang_timeout_s=args.hang_timeout)

    runs, medians = interleaved(args, args.modes, run)
    summary: dict[str, Any] = {"load_average": os.getloadavg(), "repeats": args.repeats}
    for model, times in medians.items():
        digests = {r["digest"] for r in runs if r["model"] == model and r["ok"]}
        summary[model] = {"recovery_s": times, "same_digest": len(digests) == 1}
        for other in ("traced", "restart"):
            kept, slower = times.get("kept"), times.get(other)
            if kept and slower:
                summary[model][f"{other}_over_kept"] = round(slower / kept, 2)
    print(json.dumps(summary))


def durable(args: argparse.Namespace) -> None:
    """Each model once with ``--slices 1``, the lost worker's replica files gone, against a fault-free run of the
    same layout: the share of the state read from the durable tier, and whether the results are bitwise equal."""
    summary: dict[str, Any] = {"load_average": os.getloadavg()}
    for model in args.models:
        faulted = one(
            model, "kept", steps=args.steps, kill_at=args.kill_at, hang_timeout_s=args.hang_timeout, durable=True
        )
        reference = one(model, "kept", steps=args.steps, kill_at=None, hang_timeout_s=args.hang_timeout, durable=True)
        if not args.json:
            print(json.dumps(faulted), flush=True)
        if args.check:  # in CI: nothing left behind (the run folders hold checkpoints and logs)
            for run in (faulted, reference):
                shutil.rmtree(run["run_dir"], ignore_errors=True)
        read = faulted["bytes_by_tier"]
        summary[model] = {
            "ok": faulted["ok"] and reference["ok"],
            "recovery_s": faulted["recovery_s"],
            "restored_from": faulted["restored_from"],
            "bytes_by_tier": read,
            "durable_share": round(read.get("durable", 0) / max(1, sum(read.values())), 3),
            "bitwise_equal_to_fault_free": faulted["digest"] == reference["digest"] != "",
        }
    print(json.dumps(summary))
    if args.check:
        failed = {
            model: figures
            for model, figures in summary.items()
            if isinstance(figures, dict)
            and not (figures["ok"] and figures["bitwise_equal_to_fault_free"] and 0 < figures["durable_share"] <= 0.3)
        }
        if failed:
            sys.exit(f"check failed: {json.dumps(failed)}")


if __name__ == "__main__":
    main()
