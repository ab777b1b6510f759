"""``elastic-runtime report RUN_DIR``: where a run's time went, as a table, JSON or a timeline plot.

Works on the event log of any run of the runtime (``RUN_DIR/events.jsonl``, or the log file itself).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from elastic_runtime.analysis.goodput import GoodputReport, attempts, goodput
from elastic_runtime.core.errors import EventLogError
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import (
    CheckpointCommitted,
    Event,
    Failure,
    MeshChanged,
    RecoveryCompleted,
    RunStarted,
    StepCompleted,
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report", help="goodput, badput and failures of a run, with a timeline plot", description=__doc__
    )
    parser.add_argument("run", help="a run directory (holding events.jsonl) or an event log file")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--plot", metavar="PNG", help="write a timeline plot to this PNG file")
    parser.set_defaults(func=main)
    return parser


def log_path(run: str | Path) -> Path:
    path = Path(run)
    return path / "events.jsonl" if path.is_dir() else path


def main(args: argparse.Namespace) -> int:
    path = log_path(args.run)
    try:
        events = read_events(path)
        report = goodput(events)
    except FileNotFoundError:
        print(f"error: no event log at {path}", file=sys.stderr)
        return 2
    except (EventLogError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            plot_timeline(events, report, Path(args.plot))
        except ImportError:
            print("error: --plot needs matplotlib (pip install 'elastic-runtime[plot]')", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps({"log": str(path), **report.as_dict()}))
    else:
        print(render(report, path))
        if args.plot:
            print(f"timeline: {args.plot}")
    return 0


def render(report: GoodputReport, path: Path) -> str:
    share = (lambda s: f"{s / report.wall_s:6.1%}") if report.wall_s > 0 else (lambda s: "     -")
    lines = [
        f"run {path}: {report.steps} steps in {report.wall_s:.2f} s, goodput {share(report.productive_s).strip()}",
        "",
        f"  {'category':42s} {'seconds':>9s} {'share':>7s}",
        f"  {'productive steps':42s} {report.productive_s:9.3f} {share(report.productive_s)}",
    ]
    lines += [f"  {name:42s} {sec:9.3f} {share(sec)}" for name, sec in report.badput_s.items() if sec > 0]
    if report.failures:
        lines += [
            "",
            f"  {'failure':14s} {'step':>6s} {'detect s':>9s} {'recover s':>10s} {'compile s':>10s} {'lost':>5s} "
            f"{'wasted s':>9s}  from",
        ]
        for f in report.failures:
            recovered = "never" if f.recovery_s is None else f"{f.recovery_s:.3f}"
            lines.append(
                f"  {f.kind:14s} {f.step:6d} {f.detection_s:9.3f} {recovered:>10s} {f.compile_wait_s:10.3f} "
                f"{f.lost_steps:5d} {f.wasted_s:9.3f}  {f.restored_from or '-'}"
            )
            if f.phases:  # a re-formed group: where the recovery's time went, adding up to it
                lines.append("      " + ", ".join(f"{phase} {seconds:.3f}" for phase, seconds in f.phases.items()))
            if f.tiers:  # what its restore read, per tier, and the collective that moved the shards
                read = ", ".join(f"{tier} {_moved(t)}" for tier, t in f.tiers.items())
                lines.append(f"      read: {read}; collective {f.transfer_s:.3f} s")
    if report.checkpoints:
        tiers = ", ".join(f"{tier} {count}" for tier, count in sorted(report.checkpoints.items()))
        lines += ["", f"  checkpoints committed: {tiers}"]
    if report.behind:  # due saves that waited for a write still running: the tier is slower than its cadence
        lagging = ", ".join(
            f"{tier} {lag['times']} time(s), at most {lag['most_steps']} steps"
            for tier, lag in sorted(report.behind.items())
        )
        lines.append(f"  behind the cadence: {lagging}")
    return "\n".join(lines)


def plot_timeline(events: Sequence[Event], report: GoodputReport, out: Path) -> None:
    """Committed step over time, failures and recoveries, mesh size, and checkpoint commits per tier."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    start = next(e for e in events if isinstance(e, RunStarted))
    t = timeline_clock(events)
    fig, (ax, mesh_ax) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=[3, 1])
    commits = [e for e in events if isinstance(e, StepCompleted)]
    ax.plot(
        [t(e) for e in commits], [e.step for e in commits], ".", markersize=2, color="tab:blue", label="committed step"
    )
    for failure in (e for e in events if isinstance(e, Failure) and e.step is not None):
        ax.axvline(t(failure), color="tab:red", linewidth=1)
        ax.annotate(type(failure).__name__, (t(failure), failure.step or 0), color="tab:red", fontsize=8,
                    rotation=90, va="bottom")  # fmt: skip
    for done in (e for e in events if isinstance(e, RecoveryCompleted)):
        ax.axvspan(t(done) - done.recovery_s, t(done), color="tab:orange", alpha=0.3)
    markers = ["v", "^", "s", "D"]
    tiers = sorted({e.tier for e in events if isinstance(e, CheckpointCommitted)})
    for marker, tier in zip(markers, tiers, strict=False):
        saved = [e for e in events if isinstance(e, CheckpointCommitted) and e.tier == tier]
        ax.plot([t(e) for e in saved], [e.step or 0 for e in saved], marker, color="tab:green", label=f"{tier} commit")
    ax.set_ylabel("step")
    ax.set_title(f"goodput {report.goodput or 0:.1%}, {len(report.failures)} failure(s); orange: recovery")
    ax.legend(loc="upper left", fontsize=8)
    sizes = [(0.0, _size(start.mesh_shape))] + [
        (t(e), _size(e.new_shape)) for e in events if isinstance(e, MeshChanged)
    ]
    sizes.append((report.wall_s, sizes[-1][1]))
    mesh_ax.step([s[0] for s in sizes], [s[1] for s in sizes], where="post", color="tab:purple")
    mesh_ax.set_ylabel("devices")
    mesh_ax.set_xlabel("seconds since start")
    mesh_ax.set_ylim(0, max(s[1] for s in sizes) + 1)
    mesh_ax.yaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def timeline_clock(events: Sequence[Event]) -> Callable[[Event], float]:
    """Seconds since the run's first start, for any event of any attempt.

    Within an attempt the monotonic clock counts (the wall clock may be stepped); attempts are placed by their
    starts' wall times, since each attempt is another process, possibly after a reboot or on another host,
    whose monotonic clock has another origin.
    """
    parts = attempts(events)
    first = next(e for e in parts[0] if isinstance(e, RunStarted))
    origin: dict[int, tuple[float, float]] = {}  # id(event) -> (its attempt's start mono time, that start's offset)
    for part in parts:
        started = next(e for e in part if isinstance(e, RunStarted))
        for event in part:
            origin[id(event)] = (started.mono_time, started.wall_time - first.wall_time)

    def seconds(event: Event) -> float:
        mono, offset = origin[id(event)]
        return offset + event.mono_time - mono

    return seconds


def _size(shape: dict[str, int]) -> int:
    size = 1
    for value in shape.values():
        size *= value
    return size


def _moved(tier: dict[str, float | None]) -> str:
    megabytes = (tier["bytes"] or 0) / 1e6
    if tier["mb_per_s"] is None:
        return f"{megabytes:.1f} MB"
    return f"{megabytes:.1f} MB in {tier['read_s']:.3f} s ({tier['mb_per_s']:.0f} MB/s)"
