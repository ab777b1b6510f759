"""Goodput and badput from an event log, in the categories of Google's ml-goodput-measurement.

The wall time of a run (its first event to RunFinished: under ``launch`` the first group's formation, imports
and compiles included, is ``PROGRAM_STARTUP``) is split into productive time (the computation of every
step that counts: the last commit of each step number) and badput categories named as in
``ml_goodput_measurement``'s ``BadputType``. Whatever no event accounts for (event handling, compiles after
a re-mesh, the scheduler) is ``OTHER``, so the parts always add up to the wall time.

A RAM snapshot compiled into the step (``snapshot_every=1`` on an accelerator; on CPU devices there is no
copy) is part of the step's computation here, as an
offload inside the step is for ml-goodput-measurement; only a copy the step waited for after it
(``StepCompleted.snapshot_wait_s``) is ``UNPRODUCTIVE_CHECKPOINT_SAVE_TIME``. The benchmarks charge it
against a bare step instead (``tests/benchmarks/bench_overhead.py``, ``bench_goodput.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic_runtime.core.events import (
    CheckpointBehind,
    CheckpointCommitted,
    CorruptionHealed,
    DeviceLost,
    Event,
    Failure,
    GroupFormed,
    GroupForming,
    MeshChanged,
    ProcessLost,
    RecoveryCompleted,
    RecoveryStarted,
    RunFinished,
    RunStarted,
    SilentCorruption,
    StateRestored,
    StepCompleted,
    WorkerHung,
    WorkerLost,
)

# Names as in ml_goodput_measurement's BadputType.
PROGRAM_STARTUP = "PROGRAM_STARTUP"
DATA_LOADING_SYNC = "DATA_LOADING_SYNC"
UNPRODUCTIVE_CHECKPOINT_SAVE_TIME = "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"
UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME = "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"
WASTED_PROGRESS_FROM_DISRUPTION = "WASTED_PROGRESS_FROM_DISRUPTION"
INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION = "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"
ELASTIC_SCALE_UP = "ELASTIC_SCALE_UP"
# Not ml_goodput_measurement's: the time a silent data corruption cost, found, replayed and healed (its re-run
# steps are wasted progress, as after any disruption).
SILENT_DATA_CORRUPTION = "SILENT_DATA_CORRUPTION"
OTHER = "OTHER"
BADPUT_TYPES = (
    PROGRAM_STARTUP,
    DATA_LOADING_SYNC,
    UNPRODUCTIVE_CHECKPOINT_SAVE_TIME,
    UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME,
    WASTED_PROGRESS_FROM_DISRUPTION,
    INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION,
    ELASTIC_SCALE_UP,
    SILENT_DATA_CORRUPTION,
    OTHER,
)

_DISRUPTIONS = (DeviceLost, ProcessLost, WorkerLost, WorkerHung, SilentCorruption)


@dataclass
class FailureRecord:
    """One disruption: when it was seen, how long recovery took, and what it cost."""

    kind: str
    step: int
    detection_s: float  # from the fault to its detection, where the event says (heartbeat silence)
    recovery_s: float | None  # from the failure event to the next committed step; None: never recovered
    lost_steps: int
    wasted_s: float  # computation thrown away: the failed attempt and committed steps run again
    restored_from: str
    compile_wait_s: float = 0.0  # of the recovery, waiting for the new mesh's programs to trace and compile
    # Under launch, the recovery by phase, adding up to ``recovery_s``: recruit (until the new group was asked
    # to form), forming_again (when a member lost meanwhile made it form again without it), the slowest member's
    # join (wait, leave, connect, trace, compile, load, read, and ``join_other``), and the restore and first step
    # after the group formed.
    phases: dict[str, float] = field(default_factory=dict)
    # Under launch, what the restore read from each tier (:func:`restored_tiers`) and the slowest member's part in
    # the collective that handed every member its shards.
    tiers: dict[str, dict[str, float | None]] = field(default_factory=dict)
    transfer_s: float = 0.0


def restored_tiers(done: RecoveryCompleted) -> dict[str, dict[str, float | None]]:
    """Per tier the bytes a recovery's restore read, the slowest member's read time and the rate (MB/s; None
    where nothing was read there: shards a member took from its neighbour's copy)."""
    tiers: dict[str, dict[str, float | None]] = {}
    for tier, nbytes in done.bytes_by_tier.items():
        seconds = done.read_s_by_tier.get(tier)
        rate = round(nbytes / seconds / 1e6, 1) if seconds else None
        tiers[tier] = {"bytes": nbytes, "read_s": seconds, "mb_per_s": rate}
    return tiers


@dataclass
class GoodputReport:
    """Where the wall time of one run went."""

    wall_s: float
    productive_s: float
    badput_s: dict[str, float]
    steps: int
    failures: list[FailureRecord] = field(default_factory=list)
    checkpoints: dict[str, int] = field(default_factory=dict)  # committed checkpoints per tier
    # per tier, how often a due save waited for the write before it, and the most steps the tier fell behind
    behind: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 4),
            "productive_s": round(self.productive_s, 4),
            "goodput": None if self.goodput is None else round(self.goodput, 4),
            "steps": self.steps,
            "badput_s": {k: round(v, 4) for k, v in self.badput_s.items()},
            "failures": [vars(f) | {"wasted_s": round(f.wasted_s, 4)} for f in self.failures],
            "checkpoints": self.checkpoints,
            "behind": self.behind,
        }


def goodput(events: Sequence[Event]) -> GoodputReport:
    """Account for the wall time of the run recorded in ``events``.

    A run folder used by several processes (a job killed and resumed) holds one attempt per process, each
    from its ``RunStarted``: each is accounted on its own, and the time between one attempt's last event and
    the next one's start (no process training) is a disruption, as are the steps the next attempt runs again.

    Raises:
        ValueError: the events hold no RunStarted (not the log of a run).
    """
    parts = attempts(events)
    if len(parts) < 2:
        return _one_attempt(events)
    return _combine(parts, [_one_attempt(part) for part in parts])


def attempts(events: Sequence[Event]) -> list[list[Event]]:
    """The attempts in a log: one slice per ``RunStarted`` (what comes before the first belongs to it)."""
    starts = [i for i, e in enumerate(events) if isinstance(e, RunStarted)]
    if len(starts) < 2:
        return [list(events)]
    bounds = [0, *starts[1:], len(events)]
    return [list(events[bounds[k] : bounds[k + 1]]) for k in range(len(starts))]


def _combine(parts: list[list[Event]], reports: list[GoodputReport]) -> GoodputReport:
    """One report for several attempts: a step counts once (its last commit); the gaps between attempts and
    the steps a later attempt ran again are the cost of each restart."""
    badput = dict.fromkeys(BADPUT_TYPES, 0.0)
    for report in reports:
        for kind, seconds in report.badput_s.items():
            badput[kind] += seconds
    final: dict[int, StepCompleted] = {}
    failures: list[FailureRecord] = []
    wall = sum(report.wall_s for report in reports)
    for k, (part, report) in enumerate(zip(parts, reports, strict=True)):
        failures += report.failures
        commits = [e for e in part if isinstance(e, StepCompleted) and e.step is not None]
        if k > 0:
            failures.append(_restart(parts[k - 1], part, final, badput))
            wall += max(_start_of(part).wall_time - parts[k - 1][-1].wall_time, 0.0)
        for commit in commits:
            final[commit.step or 0] = commit
    productive = sum(c.duration_s for c in final.values())
    checkpoints: dict[str, int] = {}
    behind: dict[str, dict[str, int]] = {}
    for report in reports:
        for tier, count in report.checkpoints.items():
            checkpoints[tier] = checkpoints.get(tier, 0) + count
        for tier, lag in report.behind.items():
            _add_behind(behind, tier, lag["times"], lag["most_steps"])
    return GoodputReport(
        wall_s=wall,
        productive_s=productive,
        badput_s=badput,
        steps=max(final, default=0),
        failures=failures,
        checkpoints=checkpoints,
        behind=behind,
    )


def _add_behind(behind: dict[str, dict[str, int]], tier: str, times: int, most_steps: int) -> None:
    """Count ``times`` saves of ``tier`` that waited, the most behind ``most_steps`` steps."""
    lag = behind.setdefault(tier, {"times": 0, "most_steps": 0})
    lag["times"] += times
    lag["most_steps"] = max(lag["most_steps"], most_steps)


def _start_of(part: list[Event]) -> RunStarted:
    return next(e for e in part if isinstance(e, RunStarted))


def _restart(
    before: list[Event], after: list[Event], final: dict[int, StepCompleted], badput: dict[str, float]
) -> FailureRecord:
    """What the restart between two attempts cost: the time no process trained, and the steps run again
    (``final`` holds the commits so far; those the new attempt runs again are moved to wasted progress)."""
    started = _start_of(after)
    finished = next((e for e in reversed(before) if isinstance(e, RunFinished)), None)
    gap = max(started.wall_time - before[-1].wall_time, 0.0)
    resumed_at = started.step or 0
    committed = max(final, default=0)
    redone = [final[s] for s in range(resumed_at + 1, committed + 1) if s in final]
    wasted = sum(c.duration_s for c in redone)
    # The earlier commits of those steps were counted productive by their attempt: they are wasted now.
    badput[WASTED_PROGRESS_FROM_DISRUPTION] += wasted
    if finished is not None and finished.ok:
        badput[OTHER] += gap  # a run that finished and was continued later: idle, not a disruption
    else:
        badput[INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION] += gap
    first = next((e for e in after if isinstance(e, StepCompleted)), None)
    restored = next((e for e in after if isinstance(e, StateRestored)), None)
    return FailureRecord(
        kind="ProcessRestart" if finished is None else f"RunFinished(ok={finished.ok})",
        step=committed + 1,
        detection_s=0.0,
        recovery_s=None if first is None else first.wall_time - before[-1].wall_time,
        lost_steps=max(committed - resumed_at, 0),
        wasted_s=wasted,
        restored_from="init" if restored is None else restored.restored_from,
    )


def _one_attempt(events: Sequence[Event]) -> GoodputReport:
    started = next((e for e in events if isinstance(e, RunStarted)), None)
    if started is None:
        raise ValueError("no RunStarted event: this is not the event log of a run")
    finished = next((e for e in reversed(events) if isinstance(e, RunFinished)), None)
    end = finished.mono_time if finished else events[-1].mono_time
    begin = min(events[0].mono_time, started.mono_time)  # a group's forming comes before its RunStarted
    wall = end - begin

    history: list[StepCompleted] = []  # every commit, including those a rollback made run again
    badput = dict.fromkeys(BADPUT_TYPES, 0.0)
    disruptions: list[tuple[Failure, float, RecoveryCompleted | None]] = []
    open_failure: tuple[Failure, float] | None = None  # the failure being recovered, and its attempt time
    recovering = False  # a RecoveryStarted came for it
    checkpoints: dict[str, int] = {}
    behind: dict[str, dict[str, int]] = {}

    for event in events:
        if isinstance(event, StepCompleted) and event.step is not None:
            if not history:
                # Everything before the first step's own work was start-up: starting the processes, forming
                # the group, compiling, placing the state.
                first_work = event.duration_s + event.data_s + event.snapshot_wait_s
                badput[PROGRAM_STARTUP] += max(event.mono_time - begin - first_work, 0.0)
            history.append(event)
            badput[DATA_LOADING_SYNC] += event.data_s
            badput[UNPRODUCTIVE_CHECKPOINT_SAVE_TIME] += event.snapshot_wait_s
        elif isinstance(event, _DISRUPTIONS) and open_failure is None:
            # The failed attempt ran from the last commit until the failure surfaced.
            since = history[-1].mono_time if history else started.mono_time
            open_failure, recovering = (event, max(event.mono_time - since, 0.0)), False
        elif isinstance(event, RecoveryStarted) and open_failure is not None:
            recovering = True
        elif isinstance(event, CorruptionHealed) and open_failure is not None and not recovering:
            # Under launch the members heal a transient corruption by running its step again, with no recovery of
            # their own: the replay is its recovery.
            disruptions.append((*open_failure, _replayed(open_failure[0], event)))
            open_failure = None
        elif isinstance(event, StateRestored) and open_failure is None:  # a restore that no failure led to
            badput[UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME] += event.seconds
        elif isinstance(event, MeshChanged) and not event.needs_restore:
            badput[ELASTIC_SCALE_UP] += event.seconds
        elif isinstance(event, CheckpointCommitted):
            checkpoints[event.tier] = checkpoints.get(event.tier, 0) + 1
        elif isinstance(event, CheckpointBehind):
            _add_behind(behind, event.tier, 1, event.behind_steps)
        elif isinstance(event, RecoveryCompleted) and open_failure is not None:
            disruptions.append((*open_failure, event))
            open_failure = None
    if open_failure is not None:  # the run ended (or broke) before recovering
        disruptions.append((*open_failure, None))

    final: dict[int, StepCompleted] = {c.step: c for c in history if c.step is not None}
    failures = [_record(failure, attempt_s, done, history) for failure, attempt_s, done in disruptions]
    productive = sum(c.duration_s for c in final.values())
    badput[WASTED_PROGRESS_FROM_DISRUPTION] = sum(f.wasted_s for f in failures)
    # Recovery time, less what other categories hold: the restore, the re-run step (productive), and tracing,
    # compiling or loading programs for the new mesh or group (start-up work again: PROGRAM_STARTUP).
    for record, (failure, _, done) in zip(failures, disruptions, strict=True):
        if done is not None and done.step is not None:
            rerun = final[done.step].duration_s if done.step in final else 0.0
            window = [e for e in events if failure.mono_time <= e.mono_time <= done.mono_time]
            record.phases = _reform_phases(failure, done, window, rerun)
            if record.phases:  # a re-formed group: its forming is the restore event's time; split it
                programs = sum(record.phases.get(k, 0.0) for k in ("trace", "compile", "load"))
                record.compile_wait_s = record.phases.get("trace", 0.0) + record.phases.get("compile", 0.0)
                restore = record.phases["restore"]
            else:
                programs = done.compile_wait_s
                restore = sum(e.seconds for e in window if isinstance(e, StateRestored))
            badput[PROGRAM_STARTUP] += programs
            badput[UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME] += restore
            recovery = max(done.recovery_s - restore - rerun - programs, 0.0)
            silent = isinstance(failure, SilentCorruption)
            badput[SILENT_DATA_CORRUPTION if silent else INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION] += recovery
    accounted = productive + sum(v for k, v in badput.items() if k != OTHER)
    badput[OTHER] = max(wall - accounted, 0.0)
    return GoodputReport(
        wall_s=wall,
        productive_s=productive,
        badput_s=badput,
        steps=max(final, default=0),
        failures=failures,
        checkpoints=checkpoints,
        behind=behind,
    )


def _reform_phases(failure: Failure, done: RecoveryCompleted, window: list[Event], rerun: float) -> dict[str, float]:
    """A multi-process recovery by phase (see :attr:`FailureRecord.phases`), or {} when no group re-formed in
    ``window`` (one process: the restore and compile wait are in the events as they are)."""
    formings = [e for e in window if isinstance(e, GroupForming)]
    formed = next((e for e in reversed(window) if isinstance(e, GroupFormed)), None)
    if not formings or formed is None or formed.mono_time < formings[-1].mono_time:
        return {}
    forming = formings[-1]
    phases = {"recruit": formings[0].mono_time - failure.mono_time}
    if len(formings) > 1:  # a member lost while the group formed: it formed again without (given up, or dropped)
        phases["forming_again"] = forming.mono_time - formings[0].mono_time
    joined = formed.mono_time - forming.mono_time
    member = {k: v for k, v in formed.phases.items() if v > 0}
    scale = min(1.0, joined / sum(member.values())) if member else 1.0  # the slowest member, clipped to the wait
    phases |= {k: v * scale for k, v in member.items()}
    phases["join_other"] = max(joined - sum(member.values()) * scale, 0.0)
    after = done.mono_time - formed.mono_time
    phases["first_step"] = min(rerun, after)
    phases["restore"] = after - phases["first_step"]
    return {k: round(v, 4) for k, v in phases.items()}


def _replayed(found: Failure, healed: CorruptionHealed) -> RecoveryCompleted:
    """A corruption ``healed`` by the replay of its step alone, as the recovery it was: nothing lost or restored."""
    return RecoveryCompleted(
        step=healed.step,
        source=healed.source,
        wall_time=healed.wall_time,
        mono_time=healed.mono_time,
        cause=type(found).__name__,
        failed_step=found.step or 0,
        recovery_s=healed.seconds,
        lost_steps=0,
        restored_from="replay",
        mesh_shape={},
    )


def _record(
    failure: Failure, attempt_s: float, done: RecoveryCompleted | None, history: list[StepCompleted]
) -> FailureRecord:
    """What one failure cost. Its rolled-back steps are those after the restored one, each as last
    committed before the failure."""
    lost_steps = done.lost_steps if done is not None else 0
    before = [c for c in history if c.mono_time < failure.mono_time and c.step is not None]
    newest = max((c.step for c in before if c.step is not None), default=0)
    latest = {c.step: c for c in before}  # later commits of a step overwrite earlier ones
    rolled_back = [latest[s] for s in range(newest - lost_steps + 1, newest + 1) if s in latest]
    # Heartbeat failures say how long the worker was silent before it was declared lost.
    detection = float(getattr(failure, "silent_s", 0.0) or getattr(failure, "stalled_s", 0.0))
    return FailureRecord(
        kind=type(failure).__name__,
        step=failure.step or 0,
        detection_s=detection,
        recovery_s=None if done is None else done.recovery_s,
        lost_steps=lost_steps,
        wasted_s=attempt_s + sum(c.duration_s for c in rolled_back),
        restored_from="" if done is None else done.restored_from,
        compile_wait_s=0.0 if done is None else done.compile_wait_s,
        tiers={} if done is None else restored_tiers(done),
        transfer_s=0.0 if done is None else done.transfer_s,
    )
