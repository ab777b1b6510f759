"""The notice parsers and the intake: pure functions and sync state, so no emulator; fuzzed with hypothesis."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec
import notices
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_runtime.core.errors import NoticeMalformed
from elastic_runtime.core.events import (
    HostError,
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    Notice,
    Preempted,
)
from elastic_runtime.maintenance.formats import (
    parse_custom,
    parse_gke_notification,
    parse_log_entry,
    parse_message,
    parse_upcoming_maintenance,
)
from elastic_runtime.maintenance.intake import InstanceMatcher, NoticeIntake

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- formats ------------------------------------------------------------------------------------------------


def test_log_entry_names_instance_by_name_and_id() -> None:
    (parsed,) = parse_log_entry(notices.log_entry("hostError", name="vm-a", instance_id="123"), message_id="m")
    assert isinstance(parsed.event, HostError)
    assert parsed.identities == ("vm-a", "123")
    assert parsed.event.message_id == "m"
    assert parsed.issued_at is not None and abs(parsed.issued_at - time.time()) < 60


@pytest.mark.parametrize(
    ("status", "message", "expected"),
    [
        ("PENDING", "", MaintenanceScheduled),
        ("", "", MaintenanceScheduled),
        ("ONGOING", "", MaintenanceStarted),
        ("PENDING", "Maintenance window has completed.", MaintenanceCompleted),
        ("CANCELLED", "", MaintenanceCompleted),
    ],
)
def test_upcoming_maintenance_status(status: str, message: str, expected: type[Notice]) -> None:
    data = notices.upcoming(start=100.0, end=200.0, status=status, status_message=message)
    assert type(parse_log_entry(data)[0].event) is expected


def test_upcoming_infra_maintenance_and_string_flags() -> None:
    entry = json.loads(notices.upcoming(start=100.0, end=200.0))
    entry["protoPayload"]["methodName"] = "compute.instances.upcomingInfraMaintenance"
    entry["protoPayload"]["metadata"]["canReschedule"] = "TRUE"
    (parsed,) = parse_log_entry(json.dumps(entry).encode())
    assert isinstance(parsed.event, MaintenanceScheduled)
    assert parsed.event.can_reschedule and parsed.event.window_start == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("mutate", "path"),
    [
        (lambda e: e["protoPayload"].pop("methodName"), "$.protoPayload"),
        (lambda e: e["protoPayload"].update(metadata={"windowEndTime": 5}), "$.protoPayload.metadata.windowEndTime"),
        (lambda e: e["protoPayload"]["metadata"].update(windowStartTime="2030-01-01T10:00:00"), "windowStartTime"),
        (lambda e: e.update(timestamp="yesterday"), "$.timestamp"),
        (lambda e: e["resource"].update(labels={"instance_id": 5}), "$.resource.labels"),
    ],
)
def test_log_entry_errors_name_the_path(mutate: Any, path: str) -> None:
    entry = json.loads(notices.upcoming(start=100.0, end=200.0))
    mutate(entry)
    with pytest.raises(NoticeMalformed, match=path.replace("$", r"\$").replace(".", r"\.")):
        parse_log_entry(json.dumps(entry).encode())


def test_log_entry_without_instance_is_malformed() -> None:
    entry = json.loads(notices.log_entry("preempted"))
    entry["protoPayload"]["resourceName"] = "projects/p/zones/z"
    entry["resource"]["labels"] = {}
    with pytest.raises(NoticeMalformed, match="no instance"):
        parse_log_entry(json.dumps(entry).encode())


def test_gke_notifications() -> None:
    pool = "projects/p/locations/l/clusters/train/nodePools/np"
    (started,) = parse_gke_notification(notices.gke("UpgradeEvent", {"resourceType": "NODE_POOL", "resource": pool}))
    assert isinstance(started.event, MaintenanceStarted)
    assert started.identities == ("train/np", "np", "train")
    assert parse_gke_notification(notices.gke("UpgradeAvailableEvent", {"version": "1.31"})) == []
    with pytest.raises(NoticeMalformed, match=r"at `\$\.attributes\.payload\.resourceType`"):
        parse_gke_notification(notices.gke("UpgradeEvent", {"resourceType": 3}))
    with pytest.raises(NoticeMalformed, match="cluster_name"):
        parse_gke_notification({"type_url": "type.googleapis.com/google.container.v1beta1.UpgradeEvent"})


def test_custom_format() -> None:
    (parsed,) = parse_custom(notices.custom("maintenance_started", "w-1", kind="REPAIR", issued_at=5))
    assert isinstance(parsed.event, MaintenanceStarted) and parsed.event.kind == "REPAIR"
    assert parsed.issued_at == 5.0
    with pytest.raises(NoticeMalformed, match=r"unknown field `color`"):
        parse_custom(notices.custom("preempted", "w", color="red"))
    with pytest.raises(NoticeMalformed, match=r"\$\.instance"):
        parse_custom(notices.custom("preempted", ""))
    with pytest.raises(NoticeMalformed, match="window_end"):
        parse_custom(notices.custom("maintenance_scheduled", "w", window_start=10, window_end=5))


def test_metadata_upcoming_maintenance() -> None:
    assert parse_upcoming_maintenance(b"{}", instance="vm") == []
    with pytest.raises(NoticeMalformed, match="expected a JSON object"):
        parse_upcoming_maintenance(b"[]", instance="vm")
    with pytest.raises(NoticeMalformed, match=r"\$\.window_start_time"):
        parse_upcoming_maintenance(b'{"windowStartTime": 1}', instance="vm")


# --- fuzzing: whatever arrives, the parsers return notices or raise NoticeMalformed, nothing else ------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
KEYS = [
    "protoPayload",
    "methodName",
    "metadata",
    "resource",
    "labels",
    "instance_id",
    "timestamp",
    "operation",
    "windowStartTime",
    "format",
    "event",
    "instance",
    "window_start",
]


@st.composite
def near_valid(draw: st.DrawFn) -> bytes:
    """A real notice with one value replaced by anything: the cases a careless publisher produces."""
    base = draw(
        st.sampled_from(
            [
                notices.upcoming(start=100.0, end=200.0),
                notices.log_entry("preempted"),
                notices.log_entry("terminateOnHostMaintenance", operation={"first": True}),
                notices.custom("maintenance_scheduled", "w", window_start=1, window_end=2),
            ]
        )
    )
    document = json.loads(base)
    node = document
    for _ in range(draw(st.integers(0, 3))):
        if not isinstance(node, dict) or not node:
            break
        key = draw(st.sampled_from(sorted(node)))
        if isinstance(node[key], dict) and draw(st.booleans()):
            node = node[key]
            continue
        node[key] = draw(json_values)
        break
    if isinstance(node, dict) and draw(st.booleans()):
        node[draw(st.sampled_from(KEYS))] = draw(json_values)
    return json.dumps(document).encode()


def _parses_or_is_malformed(data: bytes, attributes: dict[str, str]) -> None:
    try:
        parsed = parse_message(data, attributes, message_id="fuzz")
    except NoticeMalformed as exc:
        assert str(exc)
        return
    for notice in parsed:
        assert isinstance(notice.event, Notice)
        assert notice.event.instance
        assert notice.identities
        msgspec.json.encode(notice.event)  # it can go into the event log


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _parses_or_is_malformed(data, {})


@FUZZ
@given(json_values)
def test_fuzz_arbitrary_json(value: Any) -> None:
    _parses_or_is_malformed(json.dumps(value).encode(), {})


@FUZZ
@given(near_valid())
def test_fuzz_near_valid_notices(data: bytes) -> None:
    _parses_or_is_malformed(data, {})


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["type_url", "cluster_name", "payload", "project_id"]),
        st.text(max_size=30) | st.just("type.googleapis.com/google.container.v1beta1.UpgradeInfoEvent"),
    ),
    json_values,
)
def test_fuzz_gke_attributes(attributes: dict[str, str], payload: Any) -> None:
    if "type_url" in attributes and "payload" not in attributes:
        attributes["payload"] = json.dumps(payload)
    _parses_or_is_malformed(b"", attributes)


# --- intake ---------------------------------------------------------------------------------------------------


def test_matcher_names_ids_and_globs() -> None:
    matcher = InstanceMatcher(["vm-a", "123", "t1v-n-abcd-w-*"])
    assert matcher.canonical(["vm-a", "999"]) == "vm-a"
    assert matcher.canonical(["other", "123"]) == "123"
    assert matcher.canonical(["t1v-n-abcd-w-12", "5"]) == "t1v-n-abcd-w-12"
    assert matcher.canonical(["t1v-n-abce-w-1"]) is None
    assert InstanceMatcher().canonical(["x", "1"]) == "x"


def test_intake_retakes_a_message_whose_handling_failed() -> None:
    intake = NoticeIntake(["worker-0"])
    parsed = parse_message(notices.upcoming(start=100.0, end=200.0), {})
    assert len(intake.admit("m1", parsed)) == 1
    assert intake.admit("m2", parsed) == []  # the same window, claimed by m1 while in flight
    intake.settle("m2", handled=True)
    intake.settle("m1", handled=False)  # the run ended before m1's handlers ran: Pub/Sub redelivers
    assert not intake.is_handled("m1")
    assert len(intake.admit("m1", parsed)) == 1
    intake.settle("m1", handled=True)
    assert intake.is_handled("m1")


def test_intake_orders_lifecycle_per_instance() -> None:
    intake = NoticeIntake()
    done = parse_message(notices.log_entry("migrateOnHostMaintenance", issued=20.0, operation={"last": True}), {})
    begun = parse_message(notices.log_entry("migrateOnHostMaintenance", issued=10.0, operation={"first": True}), {})
    other = parse_message(notices.log_entry("migrateOnHostMaintenance", name="b", issued=5.0), {})
    assert [type(e) for e in intake.admit("1", done)] == [MaintenanceCompleted]
    assert intake.admit("2", begun) == []
    assert [type(e) for e in intake.admit("3", other)] == [MaintenanceStarted]  # another instance's order


def test_intake_repeats_of_windowless_notices_expire() -> None:
    now = [1000.0]
    intake = NoticeIntake(repeat_window_s=60, clock=lambda: now[0])
    preempted = parse_message(notices.custom("preempted", "w"), {})
    assert [type(e) for e in intake.admit("1", preempted)] == [Preempted]
    intake.settle("1", handled=True)
    assert intake.admit("2", preempted) == []
    now[0] += 120
    assert [type(e) for e in intake.admit("3", preempted)] == [Preempted]
