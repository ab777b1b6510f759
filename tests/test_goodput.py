"""Goodput accounting and the report command, on recorded logs whose answers are worked out by hand."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.analysis.goodput import goodput
from runtime.core.eventlog import EventLog, encode_event
from runtime.core.events import (
    CheckpointCommitted,
    CheckpointStarted,
    Event,
    MeshChanged,
    RecoveryCompleted,
    RecoveryStarted,
    RunFinished,
    RunStarted,
    SliceLost,
    StateRestored,
    StepCompleted,
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


def test_a_failure_never_recovered_is_reported_as_such() -> None:
    events = [*two_failure_run()[:9], RunFinished(step=4, mono_time=5.0, ok=False, reason="gave up")]
    report = goodput(events)
    [failure] = report.failures
    assert failure.recovery_s is None and failure.step == 5
    assert report.wall_s == pytest.approx(5.0)


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
        [sys.executable, "-m", "runtime.cli", "report", *args], capture_output=True, text=True, timeout=120,
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
