"""Events round-trip through the JSON-lines log; a bad line is reported with its number."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runtime.core.errors import EventLogError
from elastic_runtime.core.eventlog import EventLog, decode_event, encode_event, read_events
from elastic_runtime.core.events import (
    CheckpointCommitted,
    Event,
    HandlerFailed,
    MaintenanceScheduled,
    MeshChanged,
    SliceLost,
    StepCompleted,
    event_types,
)


class CustomAlert(Event, frozen=True, kw_only=True):
    """A user-defined event: logged and read back like a built-in one."""

    level: int


SAMPLES: list[Event] = [
    StepCompleted(step=3, duration_s=0.01, loss=0.5, mesh_shape={"data": 4, "model": 2}, data_position=3),
    SliceLost(step=9, devices=(6, 7), status="DATA_LOSS", slices=(3,), slice_size=2, error_type="E", message="m"),
    MeshChanged(old_shape={"data": 4}, new_shape={"data": 3}, devices=(0, 1, 2), reason="r", needs_restore=True),
    HandlerFailed(handler="h", event_type="StepCompleted", timed_out=True),
    CheckpointCommitted(step=5, tier="disk", path="/x", bytes=10, seconds=0.1),
    MaintenanceScheduled(instance="t1v-n-abc-w-0", window_start=1.0, window_end=2.0, can_reschedule=True),
    CustomAlert(level=3),
]


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_event_round_trips_as_json(event: Event) -> None:
    data = encode_event(event)
    assert data.startswith(b'{"type":"' + type(event).__name__.encode())
    assert decode_event(data) == event


def test_events_are_frozen() -> None:
    event = SAMPLES[0]
    with pytest.raises(AttributeError):
        event.step = 4  # type: ignore[misc]


def test_event_types_include_builtins_and_user_subclasses() -> None:
    names = {cls.__name__ for cls in event_types()}
    assert {"StepCompleted", "SliceLost", "DeviceLost", "CustomAlert"} <= names


def test_the_log_reads_back_in_order(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "run" / "events.jsonl")
    for event in SAMPLES:
        log.append(event)
    log.close()
    assert read_events(tmp_path / "run" / "events.jsonl") == SAMPLES


def test_a_line_torn_by_a_kill_is_dropped_before_the_log_is_appended_to(tmp_path: Path) -> None:
    # A controller killed mid-write leaves half a line; the resumed run's controller appends to the same log.
    path = tmp_path / "events.jsonl"
    path.write_bytes(encode_event(SAMPLES[0]) + b"\n" + encode_event(SAMPLES[1])[:10])
    log = EventLog(path)
    log.append(SAMPLES[2])
    log.close()
    assert read_events(path) == [SAMPLES[0], SAMPLES[2]]


def test_a_corrupt_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lines = [encode_event(SAMPLES[0]), b'{"type":"StepCompleted","step":"three"}', encode_event(SAMPLES[1])]
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(EventLogError, match=r"events.jsonl:2: not a valid event"):
        read_events(path)


def test_an_unknown_event_type_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"type":"NoSuchEvent"}\n')
    with pytest.raises(EventLogError, match=r":1: .*NoSuchEvent"):
        read_events(path)
