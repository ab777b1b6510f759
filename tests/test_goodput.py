"""Goodput accounting and the report command, on recorded logs whose answers are worked out by hand."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runtime.analysis.goodput import (
    INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION,
    SILENT_DATA_CORRUPTION,
    WASTED_PROGRESS_FROM_DISRUPTION,
    goodput,
)
from elastic_runtime.cli.report import render, timeline_clock
from elastic_runtime.core.eventlog import EventLog, encode_event
from elastic_runtime.core.events import (
    CheckpointBehind,
    CheckpointCommitted,
    CheckpointStarted,
    CorruptionHealed,
    Event,
    GroupFormed,
    GroupForming,
    MeshChanged,
    RecoveryCompleted,
    RecoveryStarted,
    RunFinished,
    RunStarted,
    SilentCorruption,
    SliceLost,
    StateRestored,
    StepCompleted,
    WorkerLost,
)

SHAPE8 = {"data": 4, "model": 2}
SHAPE6 = {"data": 3, "model": 2}


def commit(step: int, at: float, duration: float = 0.5, data: float = 0.0, wait: float = 0.0) -> StepCompleted:
    return StepCompleted(
        step=step, mono_time=at, duration_s=duration, mesh_shape=SHAPE8, data_position=step, data_s=data,
        snapshot_wait_s=wait,
    )  # fmt: skip


def two_failure_run() -> list[Event]:
    """A 10 s run, worked out by hand.

    t=0 start; the first step commits at t=2.0 (1.5 s of start-up, then 0.5 s of work). Steps 2..4 commit
    every 0.5 s. Step 5 fails at t=3.7 (its attempt since t=3.5 is wasted). The restore (0.1 s) goes back to
    step 3 (the snapshot of step 4 was not complete): step 4 is lost. Step 4 commits again at t=4.3,
    recovery 0.6 s. Then steps 5..7 every 0.5 s, a second failure at step 8 (t=6.0, after 0.2 s of attempt),
    restore 0.2 s from disk to step 7 (nothing lost), step 8 commits at t=7.0 (recovery 1.0 s). Then a
    scale-up reshard of 0.3 s, steps 9 and 10. Two disk checkpoints overlap steps in flight.
    """
    return [
        RunStarted(step=0, mono_time=0.0, target_steps=10, mesh_shape=SHAPE8, devices=tuple(range(8))),
        commit(1, 2.0, data=0.1),
        CheckpointStarted(step=1, mono_time=2.1, tier="disk"),
        commit(2, 2.5),
        commit(3, 3.0, wait=0.05),
        CheckpointCommitted(step=1, mono_time=3.1, tier="disk", path="d/1", bytes=10, seconds=1.0),
        commit(4, 3.5),
        SliceLost(step=5, mono_time=3.7, devices=(6, 7), slices=(3,), slice_size=2),
        RecoveryStarted(step=5, mono_time=3.7, cause="SliceLost", last_committed_step=4),
        MeshChanged(
            step=4,
            mono_time=3.75,
            old_shape=SHAPE8,
            new_shape=SHAPE6,
            devices=tuple(range(6)),
            reason="x",
            needs_restore=True,
        ),
        StateRestored(step=3, mono_time=3.85, restored_from="ram", lost_steps=1, seconds=0.1),
        commit(4, 4.3),
        RecoveryCompleted(
            step=4,
            mono_time=4.3,
            cause="SliceLost",
            failed_step=5,
            recovery_s=0.6,
            lost_steps=1,
            restored_from="ram",
            mesh_shape=SHAPE6,
        ),
        commit(5, 4.8),
        CheckpointStarted(step=5, mono_time=4.9, tier="disk"),
        commit(6, 5.3),
        commit(7, 5.8),
        SliceLost(step=8, mono_time=6.0, devices=(4, 5), slices=(2,), slice_size=2),
        CheckpointCommitted(step=5, mono_time=6.1, tier="disk", path="d/5", bytes=10, seconds=1.2),
        StateRestored(step=7, mono_time=6.3, restored_from="disk", lost_steps=0, seconds=0.2),
        commit(8, 7.0),
        RecoveryCompleted(
            step=8,
            mono_time=7.0,
            cause="SliceLost",
            failed_step=8,
            recovery_s=1.0,
            lost_steps=0,
            restored_from="disk",
            mesh_shape=SHAPE6,
        ),
        MeshChanged(
            step=8,
            mono_time=7.4,
            old_shape=SHAPE6,
            new_shape=SHAPE8,
            devices=tuple(range(8)),
            reason="scale-up",
            needs_restore=False,
            seconds=0.3,
        ),
        commit(9, 7.9),
        commit(10, 8.4),
        RunFinished(step=10, mono_time=10.0, ok=True),
    ]


def test_a_run_with_two_failures_and_overlapping_checkpoints() -> None:
    report = goodput(two_failure_run())
    assert report.wall_s == pytest.approx(10.0)
    assert report.steps == 10
    assert report.productive_s == pytest.approx(10 * 0.5)  # each step's last commit counts once
    badput = report.badput_s
    assert badput["PROGRAM_STARTUP"] == pytest.approx(2.0 - 0.5 - 0.1)
    assert badput["DATA_LOADING_SYNC"] == pytest.approx(0.1)
    assert badput["UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"] == pytest.approx(0.05)
    assert badput["UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"] == pytest.approx(0.1 + 0.2)
    # failure 1: attempt 3.5 -> 3.7 plus the lost step 4 (0.5 s); failure 2: attempt 5.8 -> 6.0
    assert badput["WASTED_PROGRESS_FROM_DISRUPTION"] == pytest.approx(0.2 + 0.5 + 0.2)
    # recovery less restore less the re-run step: (0.6 - 0.1 - 0.5) + (1.0 - 0.2 - 0.5)
    assert badput["INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"] == pytest.approx(0.0 + 0.3)
    assert badput["ELASTIC_SCALE_UP"] == pytest.approx(0.3)
    assert report.productive_s + sum(badput.values()) == pytest.approx(report.wall_s)
    assert report.goodput == pytest.approx(0.5)
    first, second = report.failures
    assert (first.kind, first.step, first.lost_steps, first.restored_from) == ("SliceLost", 5, 1, "ram")
    assert first.recovery_s == pytest.approx(0.6) and first.wasted_s == pytest.approx(0.7)
    assert (second.step, second.lost_steps, second.restored_from) == (8, 0, "disk")
    assert second.wasted_s == pytest.approx(0.2)
    assert report.checkpoints == {"disk": 2}


def group(generation: int, forming: float, formed: float, phases: dict[str, float]) -> list[Event]:
    members = (0, 1, 2)
    return [
        GroupForming(step=0, mono_time=forming, generation=generation, members=members, strategy="x"),
        GroupFormed(
            step=0, mono_time=formed, generation=generation, members=members, coordinator="c", strategy="x",
            seconds=formed - forming, restore_step=0, restore_source=0, phases=phases,
        ),
    ]  # fmt: skip


def test_under_launch_the_first_forming_is_start_up_and_a_reforming_is_split_by_phase() -> None:
    """A 10.3 s launched run, worked out by hand: the first group forms from t=0 to 5 (its compile included),
    steps every 0.5 s from t=6; worker 1 lost at t=7.8 (step 5's attempt since 7.5 wasted); the new group is
    asked to form at 8.0, formed at 9.0 (its slowest member: leave 0.1, connect 0.3, trace 0.2, compile 0.3,
    read 0.05), step 5 commits at 9.8: recovery 2.0 s, of which 0.3 s restore after the forming."""
    joined = {"leave": 0.1, "connect": 0.3, "trace": 0.2, "compile": 0.3, "load": 0.0, "read": 0.05}
    events = [
        *group(1, 0.0, 5.0, {"trace": 1.0, "compile": 3.0}),
        RunStarted(step=0, mono_time=5.1, target_steps=6, mesh_shape=SHAPE8, devices=tuple(range(8))),
        *(commit(step, 6.0 + 0.5 * (step - 1)) for step in range(1, 5)),
        WorkerLost(step=5, mono_time=7.8, worker=1, silent_s=0.2),
        *group(2, 8.0, 9.0, joined),
        StateRestored(step=4, mono_time=9.0, restored_from="ram", lost_steps=0, seconds=1.2),
        commit(5, 9.8),
        RecoveryCompleted(
            step=5, mono_time=9.8, cause="WorkerLost", failed_step=5, recovery_s=2.0, lost_steps=0,
            restored_from="ram", mesh_shape=SHAPE8,
        ),
        commit(6, 10.3),
        RunFinished(step=6, mono_time=10.3, ok=True),
    ]  # fmt: skip
    report = goodput(events)
    assert report.wall_s == pytest.approx(10.3)
    badput = report.badput_s
    # Start-up: until step 1's own work (6.0 - 0.5), and the re-formed group's trace and compile.
    assert badput["PROGRAM_STARTUP"] == pytest.approx(5.5 + 0.5)
    assert badput["UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"] == pytest.approx(0.3)  # not the 1.2 s of forming
    assert badput[INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION] == pytest.approx(2.0 - 0.3 - 0.5 - 0.5)
    assert report.productive_s + sum(badput.values()) == pytest.approx(report.wall_s)
    (failure,) = report.failures
    assert failure.compile_wait_s == pytest.approx(0.5)
    assert failure.phases == pytest.approx(
        {
            "recruit": 0.2,
            **{k: v for k, v in joined.items() if v},
            "join_other": 0.05,
            "first_step": 0.5,
            "restore": 0.3,
        }
    )
    assert sum(failure.phases.values()) == pytest.approx(failure.recovery_s)


def test_a_forming_given_up_for_another_is_its_own_phase() -> None:
    """As above, but a second worker is lost while generation 2 forms (at 9.0): generation 3 is asked to form at
    9.1 and forms at 9.6; step 5 commits at 10.4. The 1.1 s between the two formings is ``forming_again``, not
    recruiting; the phases still add up to the recovery."""
    joined = {"connect": 0.1, "load": 0.2}
    events = [
        *group(1, 0.0, 5.0, {"trace": 1.0, "compile": 3.0}),
        RunStarted(step=0, mono_time=5.1, target_steps=5, mesh_shape=SHAPE8, devices=tuple(range(8))),
        *(commit(step, 6.0 + 0.5 * (step - 1)) for step in range(1, 5)),
        WorkerLost(step=5, mono_time=7.8, worker=1, silent_s=0.8),
        group(2, 8.0, 8.0, {})[0],  # its GroupForming only: it never formed
        WorkerLost(step=5, mono_time=9.0, worker=2, silent_s=2.0),
        *group(3, 9.1, 9.6, joined),
        commit(5, 10.4),
        RecoveryCompleted(
            step=5, mono_time=10.4, cause="WorkerLost", failed_step=5, recovery_s=2.6, lost_steps=0,
            restored_from="ram", mesh_shape=SHAPE8,
        ),
        RunFinished(step=5, mono_time=10.4, ok=True),
    ]  # fmt: skip
    (failure,) = goodput(events).failures
    assert failure.phases == pytest.approx(
        {"recruit": 0.2, "forming_again": 1.1, **joined, "join_other": 0.2, "first_step": 0.5, "restore": 0.3}
    )
    assert sum(failure.phases.values()) == pytest.approx(failure.recovery_s)


def test_a_failure_never_recovered_is_reported_as_such() -> None:
    events = [*two_failure_run()[:9], RunFinished(step=4, mono_time=5.0, ok=False, reason="gave up")]
    report = goodput(events)
    [failure] = report.failures
    assert failure.recovery_s is None and failure.step == 5
    assert report.wall_s == pytest.approx(5.0)


def test_a_tier_behind_its_cadence_is_counted_with_how_far_and_printed() -> None:
    lagging = [
        CheckpointBehind(step=4, mono_time=2.6, tier="gcs", writing=2, behind_steps=4),  # nothing in GCS yet
        CheckpointBehind(step=8, mono_time=6.1, tier="gcs", writing=4, behind_steps=6),
    ]
    report = goodput(sorted([*two_failure_run(), *lagging], key=lambda e: e.mono_time))
    assert report.behind == {"gcs": {"times": 2, "most_steps": 6}}
    assert "behind the cadence: gcs 2 time(s), at most 6 steps" in render(report, Path("events.jsonl"))
    assert goodput(two_failure_run()).behind == {}


def test_not_a_run() -> None:
    with pytest.raises(ValueError, match="no RunStarted"):
        goodput([commit(1, 1.0)])


def write_log(path: Path, events: list[Event]) -> None:
    log = EventLog(path)
    for event in events:
        log.append(event)
    log.close()


def report_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastic_runtime.cli", "report", *args], capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip


def test_report_prints_a_table_and_json(tmp_path: Path) -> None:
    write_log(tmp_path / "events.jsonl", two_failure_run())
    table = report_cli(str(tmp_path))
    assert table.returncode == 0, table.stderr
    assert "goodput 50.0%" in table.stdout
    assert "WASTED_PROGRESS_FROM_DISRUPTION" in table.stdout and "SliceLost" in table.stdout
    as_json = report_cli(str(tmp_path), "--json")
    data = json.loads(as_json.stdout)
    assert data["goodput"] == 0.5 and len(data["failures"]) == 2


def test_report_writes_a_valid_png_timeline(tmp_path: Path) -> None:
    write_log(tmp_path / "events.jsonl", two_failure_run())
    out = tmp_path / "plots" / "timeline.png"
    proc = report_cli(str(tmp_path), "--plot", str(out))
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (1000, 600)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda lines: [*lines[:3], b'{"type":"StepCompleted","step":'], r"events.jsonl:4: not a valid event"),
        (lambda lines: [*lines[:2], b"not json at all", *lines[2:]], r"events.jsonl:3: not a valid event"),
    ],
    ids=["truncated", "malformed"],
)
def test_report_names_the_bad_line(tmp_path: Path, damage: object, message: str) -> None:
    lines = [encode_event(e) for e in two_failure_run()]
    (tmp_path / "events.jsonl").write_bytes(b"\n".join(damage(lines)) + b"\n")  # type: ignore[operator]
    proc = report_cli(str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and __import__("re").search(message, proc.stderr), proc.stderr


def test_report_on_a_missing_log(tmp_path: Path) -> None:
    proc = report_cli(str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no event log" in proc.stderr


def killed_and_resumed_run() -> list[Event]:
    """Two processes in one log, worked out by hand.

    The first (monotonic clock = wall time - 100) commits steps 1-4, one a second from wall time 101, each
    0.5 s of work, and is killed after step 4 (no RunFinished). No process trains from 104 to 110. The second
    (another process: monotonic clock = wall time + 390) resumes at step 2 from GCS (0.3 s), so steps 3 and 4
    run again, and commits steps 3-6 from 111, then finishes at 114.5.
    """

    def at(wall: float, offset: float) -> dict[str, float]:
        return {"wall_time": wall, "mono_time": wall + offset}

    first = [
        RunStarted(step=0, target_steps=6, mesh_shape=SHAPE8, devices=tuple(range(8)), **at(100.0, -100.0)),
        *(
            StepCompleted(step=s, duration_s=0.5, mesh_shape=SHAPE8, data_position=s, **at(100.0 + s, -100.0))
            for s in range(1, 5)
        ),
    ]
    second = [
        RunStarted(step=2, target_steps=6, mesh_shape=SHAPE8, devices=tuple(range(8)), **at(110.0, 390.0)),
        StateRestored(step=2, restored_from="gcs", lost_steps=0, seconds=0.3, **at(110.3, 390.0)),
        *(
            StepCompleted(step=s, duration_s=0.5, mesh_shape=SHAPE8, data_position=s, **at(108.0 + s, 390.0))
            for s in range(3, 7)
        ),
        RunFinished(step=6, ok=True, **at(114.5, 390.0)),
    ]
    return first + second


def test_a_killed_and_resumed_run_counts_the_restart_as_a_disruption() -> None:
    report = goodput(killed_and_resumed_run())
    assert report.wall_s == pytest.approx(4.0 + 6.0 + 4.5)  # each process's time and the gap between them
    assert report.steps == 6
    assert report.productive_s == pytest.approx(6 * 0.5)  # each step once, as last committed
    assert report.badput_s[WASTED_PROGRESS_FROM_DISRUPTION] == pytest.approx(2 * 0.5)  # steps 3, 4 run twice
    assert report.badput_s[INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION] == pytest.approx(6.0)  # nobody trained
    assert report.productive_s + sum(report.badput_s.values()) == pytest.approx(report.wall_s)
    (restart,) = report.failures
    assert (restart.kind, restart.step, restart.lost_steps, restart.restored_from) == ("ProcessRestart", 5, 2, "gcs")
    assert restart.recovery_s == pytest.approx(111.0 - 104.0) and restart.wasted_s == pytest.approx(1.0)


def test_the_timeline_places_each_attempt_by_wall_time_and_counts_within_it_by_its_own_clock() -> None:
    events = killed_and_resumed_run()
    t = timeline_clock(events)
    assert [round(t(e), 6) for e in events if isinstance(e, StepCompleted)] == [1, 2, 3, 4, 11, 12, 13, 14]
    assert t(events[-1]) == pytest.approx(14.5)  # mono times 500 s apart between the processes: ignored


def test_under_launch_a_transient_corruption_healed_by_its_replay_is_a_recovery_of_its_own() -> None:
    # The members run step 5 again (no RecoveryStarted): the replay closes the failure, so a later loss is booked
    # as its own failure, not as this one's recovery.
    found = SilentCorruption(step=5, mono_time=3.6, suspects=(0, 2), digests={}, replicas=2, attributed=False)
    healed = CorruptionHealed(step=5, mono_time=3.9, kind="transient", suspects=(0, 2), seconds=0.3)
    events = [
        RunStarted(step=0, mono_time=0.0, target_steps=8, mesh_shape=SHAPE8, devices=tuple(range(8))),
        *(commit(s, 1.0 + 0.5 * s) for s in range(1, 5)),
        found,
        healed,
        commit(5, 4.0, duration=0.1),
        WorkerLost(step=6, mono_time=4.4, worker=1, silent_s=0.0),
        RecoveryStarted(step=6, mono_time=4.4, cause="WorkerLost", last_committed_step=5),
        RecoveryCompleted(
            step=6,
            mono_time=5.5,
            cause="WorkerLost",
            failed_step=6,
            recovery_s=1.1,
            lost_steps=0,
            restored_from="ram",
            mesh_shape=SHAPE8,
        ),
        commit(6, 5.5),
        RunFinished(step=6, mono_time=6.0, ok=True),
    ]
    report = goodput(events)
    corrupted, lost = report.failures
    assert (corrupted.kind, corrupted.recovery_s, corrupted.restored_from) == ("SilentCorruption", 0.3, "replay")
    assert (lost.kind, lost.recovery_s) == ("WorkerLost", 1.1)
    assert report.badput_s[SILENT_DATA_CORRUPTION] == pytest.approx(0.3 - 0.1)  # the healed step's re-run is work
