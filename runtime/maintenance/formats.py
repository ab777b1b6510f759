"""Parsers for the notice formats Google Cloud (and our users) publish: pure functions from bytes to events.

Three formats arrive on a Pub/Sub subscription, told apart by their shape:

- **Cloud Logging sink** messages: the data is one ``LogEntry`` in JSON whose ``protoPayload`` is a Compute
  Engine system-event audit entry. ``protoPayload.methodName`` says what happened
  (``compute.instances.upcomingMaintenance`` / ``upcomingInfraMaintenance`` with the window in
  ``protoPayload.metadata``, ``terminateOnHostMaintenance``, ``migrateOnHostMaintenance``, ``preempted``,
  ``hostError``); the instance is named by ``protoPayload.resourceName`` (``.../instances/NAME``) and
  ``resource.labels.instance_id``.
- **GKE cluster notifications**: the attributes carry ``type_url``, ``cluster_name`` and a JSON ``payload``;
  the data is a human-readable summary. Node-pool upgrades are the maintenance that touches our workers.
- **Our own format** (:data:`CUSTOM_FORMAT`) for anyone who wants to announce maintenance themselves::

      {"format": "elastic-runtime.notice/v1", "event": "maintenance_scheduled", "instance": "worker-3",
       "window_start": "2026-12-01T10:00:00Z", "window_end": "2026-12-01T11:00:00Z",
       "can_reschedule": false, "kind": "SCHEDULED", "issued_at": "2026-11-30T09:00:00Z"}

  ``event`` is one of ``maintenance_scheduled``, ``maintenance_started``, ``maintenance_completed``,
  ``preempted``, ``host_error``; times are RFC 3339 strings with a zone, or epoch seconds; only ``format``,
  ``event`` and ``instance`` are required.

Every parser raises :class:`~elastic_runtime.core.errors.NoticeMalformed` with the JSON path of the first bad value
(``at $.protoPayload.metadata.windowStartTime``). A well-formed message that announces nothing we act on
(a GKE security bulletin, a control-plane upgrade) parses to an empty list.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from elastic_runtime.core.errors import NoticeMalformed
from elastic_runtime.core.events import (
    HostError,
    MaintenanceCompleted,
    MaintenanceScheduled,
    MaintenanceStarted,
    Notice,
    Preempted,
)

__all__ = [
    "CUSTOM_FORMAT",
    "ParsedNotice",
    "parse_custom",
    "parse_gke_notification",
    "parse_log_entry",
    "parse_message",
    "parse_upcoming_maintenance",
]

CUSTOM_FORMAT = "elastic-runtime.notice/v1"

# Timestamps must carry a zone: a naive one would silently be read in the listener's local time.
Timestamp = Annotated[dt.datetime, msgspec.Meta(tz=True)]


class ParsedNotice(msgspec.Struct, frozen=True, kw_only=True):
    """One notice as parsed, before it is matched against this job's instances.

    Attributes:
        event: the event to publish (its ``instance`` is rewritten to the configured name on a match).
        identities: every name the source gave the instance (name, numeric id, cluster/node pool).
        issued_at: when the source says the notice was issued (epoch s); orders out-of-order deliveries.
        project: the Google Cloud project the instance is in, where the source says; "": not said.
    """

    event: Notice
    identities: tuple[str, ...]
    issued_at: float | None = None
    project: str = ""


def _epoch(value: dt.datetime | float | None) -> float | None:
    if value is None or isinstance(value, int | float):
        return None if value is None else float(value)
    return value.timestamp()


def _flag(value: bool | str | None) -> bool:
    """``canReschedule`` arrives as a JSON boolean or, from the metadata server, as the string "true"."""
    return value is True or (isinstance(value, str) and value.strip().lower() == "true")


def _malformed(exc: msgspec.MsgspecError, where: str, prefix: str = "") -> NoticeMalformed:
    message = str(exc)
    if prefix:
        # Errors from a nested convert() say "$..."; re-root them so the path names the whole message.
        message = message.replace("at `$", f"at `{prefix}")
    return NoticeMalformed(f"{where}: {message}")


# --- Cloud Logging: Compute Engine system events ------------------------------------------------------------

UPCOMING = ("compute.instances.upcomingMaintenance", "compute.instances.upcomingInfraMaintenance")
TERMINATE = "compute.instances.terminateOnHostMaintenance"
MIGRATE = "compute.instances.migrateOnHostMaintenance"
PREEMPTED = "compute.instances.preempted"
HOST_ERROR = "compute.instances.hostError"
# Compute Engine closes a maintenance window with an upcomingMaintenance entry carrying this status message.
_COMPLETED_MESSAGE = "maintenance window has completed"


class _Resource(msgspec.Struct, frozen=True):
    type: str = ""
    labels: dict[str, str] = {}


class _Operation(msgspec.Struct, frozen=True):
    id: str = ""
    first: bool = False
    last: bool = False


class _Status(msgspec.Struct, frozen=True):
    code: int = 0
    message: str = ""


class _AuditLog(msgspec.Struct, frozen=True, rename="camel"):
    method_name: str
    resource_name: str = ""
    # Kept loose here: only upcomingMaintenance entries have a window, validated by _WindowMetadata.
    metadata: dict[str, Any] | None = None
    status: _Status | None = None


class _LogEntry(msgspec.Struct, frozen=True, rename="camel"):
    proto_payload: _AuditLog
    resource: _Resource = _Resource()
    timestamp: Timestamp | None = None
    insert_id: str = ""
    operation: _Operation | None = None


class _WindowMetadata(msgspec.Struct, frozen=True, rename="camel"):
    type: str = ""
    window_start_time: Timestamp | None = None
    window_end_time: Timestamp | None = None
    latest_window_start_time: Timestamp | None = None
    can_reschedule: bool | str | None = None
    maintenance_status: str = ""


_log_entry_decoder = msgspec.json.Decoder(_LogEntry)


def _instance_identities(entry: _LogEntry) -> tuple[str, ...]:
    names: list[str] = []
    parts = entry.proto_payload.resource_name.split("/")
    if len(parts) >= 2 and parts[-2] == "instances" and parts[-1]:
        names.append(parts[-1])
    instance_id = entry.resource.labels.get("instance_id", "")
    if instance_id:
        names.append(instance_id)
    return tuple(names)


def parse_log_entry(data: bytes, *, message_id: str = "") -> list[ParsedNotice]:
    """Parse a Cloud Logging sink message carrying a Compute Engine system-event audit entry.

    Raises:
        NoticeMalformed: not JSON, a field of the wrong type (the path is named), no instance named, or a
            ``methodName`` that is not one of the maintenance, preemption or host-error events.
    """
    try:
        entry = _log_entry_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise _malformed(exc, "Cloud Logging entry") from exc
    identities = _instance_identities(entry)
    if not identities:
        raise NoticeMalformed(
            "Cloud Logging entry: no instance at `$.protoPayload.resourceName` or `$.resource.labels.instance_id`"
        )
    method = entry.proto_payload.method_name
    common: dict[str, Any] = {"instance": identities[0], "message_id": message_id, "source": "cloud-logging"}
    issued = _epoch(entry.timestamp)
    event: Notice
    if method in UPCOMING:
        try:
            window = msgspec.convert(entry.proto_payload.metadata or {}, _WindowMetadata)
        except msgspec.MsgspecError as exc:
            raise _malformed(exc, "Cloud Logging entry", "$.protoPayload.metadata") from exc
        status = window.maintenance_status.upper()
        status_message = (entry.proto_payload.status or _Status()).message.lower()
        if _COMPLETED_MESSAGE in status_message or status in ("COMPLETE", "COMPLETED"):
            event = MaintenanceCompleted(kind=window.type or "SCHEDULED", **common)
        elif status in ("CANCELLED", "CANCELED"):
            # A cancelled window needs the same response as a finished one: stop draining, re-admit.
            event = MaintenanceCompleted(kind="CANCELLED", **common)
        elif status == "ONGOING":
            event = MaintenanceStarted(kind=window.type or "SCHEDULED", **common)
        else:
            event = MaintenanceScheduled(
                kind=window.type or "SCHEDULED",
                window_start=_epoch(window.window_start_time),
                window_end=_epoch(window.window_end_time),
                can_reschedule=_flag(window.can_reschedule),
                **common,
            )
    elif method in (TERMINATE, MIGRATE):
        kind = "TERMINATE_ON_HOST_MAINTENANCE" if method == TERMINATE else "MIGRATE_ON_HOST_MAINTENANCE"
        # System events come as an operation: its first entry opens it, its last entry closes it.
        closed = entry.operation is not None and entry.operation.last and not entry.operation.first
        event = (MaintenanceCompleted if closed else MaintenanceStarted)(kind=kind, **common)
    elif method == PREEMPTED:
        event = Preempted(kind="PREEMPTED", **common)
    elif method == HOST_ERROR:
        event = HostError(kind="HOST_ERROR", **common)
    else:
        raise NoticeMalformed(f"Cloud Logging entry: unknown methodName {method!r} at `$.protoPayload.methodName`")
    return [ParsedNotice(event=event, identities=identities, issued_at=issued, project=_project(entry))]


def _project(entry: _LogEntry) -> str:
    """The instance's project: ``resource.labels.project_id``, else ``projects/P/...`` of the resource name."""
    parts = entry.proto_payload.resource_name.split("/")
    named = parts[1] if len(parts) > 1 and parts[0] == "projects" else ""
    return entry.resource.labels.get("project_id", "") or named


# --- GKE cluster notifications -----------------------------------------------------------------------------

_GKE_TYPE_PREFIX = "type.googleapis.com/google.container."


class _UpgradeEvent(msgspec.Struct, frozen=True, rename="camel"):
    resource_type: str = ""
    operation: str = ""
    operation_start_time: Timestamp | None = None
    current_version: str = ""
    target_version: str = ""
    resource: str = ""


class _UpgradeInfoEvent(msgspec.Struct, frozen=True, rename="camel"):
    resource_type: str = ""
    operation: str = ""
    start_time: Timestamp | None = None
    end_time: Timestamp | None = None
    current_version: str = ""
    target_version: str = ""
    resource: str = ""
    state: str = ""
    event_type: str = ""


def _node_pool(resource: str) -> str:
    parts = resource.split("/")
    return parts[parts.index("nodePools") + 1] if "nodePools" in parts[:-1] else ""


def parse_gke_notification(attributes: Mapping[str, str], *, message_id: str = "") -> list[ParsedNotice]:
    """Parse a GKE cluster notification (its attributes; the data is only a summary for people).

    Node-pool upgrades are maintenance of our workers: an ``UpgradeEvent`` means one started; an
    ``UpgradeInfoEvent`` says STARTED, a final state (SUCCEEDED, FAILED, CANCELED), or, with a start in the
    future, a scheduled window. Control-plane upgrades, available versions and security bulletins touch no
    worker and parse to nothing. The instance is ``CLUSTER/NODE_POOL`` (identities: that, the node pool,
    the cluster).

    Raises:
        NoticeMalformed: a missing attribute, a payload that is not JSON, or a field of the wrong type.
    """
    type_url = attributes.get("type_url", "")
    cluster = attributes.get("cluster_name", "")
    if not cluster:
        raise NoticeMalformed("GKE notification: missing attribute `cluster_name`")
    if not type_url.startswith(_GKE_TYPE_PREFIX):
        raise NoticeMalformed(f"GKE notification: unknown attribute type_url {type_url!r}")
    kind = type_url.rsplit(".", 1)[-1]
    payload_type: type[_UpgradeEvent] | type[_UpgradeInfoEvent]
    if kind == "UpgradeEvent":
        payload_type = _UpgradeEvent
    elif kind == "UpgradeInfoEvent":
        payload_type = _UpgradeInfoEvent
    elif kind in ("UpgradeAvailableEvent", "SecurityBulletinEvent"):
        return []
    else:
        raise NoticeMalformed(f"GKE notification: unknown attribute type_url {type_url!r}")
    try:
        payload = msgspec.json.decode(attributes.get("payload", "").encode(), type=payload_type)
    except msgspec.MsgspecError as exc:
        raise _malformed(exc, "GKE notification", "$.attributes.payload") from exc
    if payload.resource_type.upper() != "NODE_POOL":
        return []
    pool = _node_pool(payload.resource)
    instance = f"{cluster}/{pool}" if pool else cluster
    identities = tuple(dict.fromkeys(n for n in (instance, pool, cluster) if n))
    detail = f"GKE_UPGRADE {payload.current_version} -> {payload.target_version}".strip()
    common: dict[str, Any] = {"instance": instance, "message_id": message_id, "source": "gke", "kind": detail}
    event: Notice
    if isinstance(payload, _UpgradeEvent):
        event = MaintenanceStarted(**common)
        issued = _epoch(payload.operation_start_time)
    else:
        state = payload.state.upper()
        issued = _epoch(payload.start_time)
        if state in ("SUCCEEDED", "FAILED", "CANCELED", "CANCELLED"):
            event = MaintenanceCompleted(**common)
            issued = _epoch(payload.end_time) or issued
        elif state == "STARTED":
            event = MaintenanceStarted(**common)
        elif issued is not None:
            event = MaintenanceScheduled(window_start=issued, window_end=_epoch(payload.end_time), **common)
            issued = None  # a schedule is issued before its window: the start does not order it
        else:
            raise NoticeMalformed(f"GKE notification: UpgradeInfoEvent state {payload.state!r} at `$.payload.state`")
    return [ParsedNotice(event=event, identities=identities, issued_at=issued)]


# --- our own format ---------------------------------------------------------------------------------------


class _Custom(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="event"):
    format: Literal["elastic-runtime.notice/v1"]
    instance: Annotated[str, msgspec.Meta(min_length=1)]
    kind: str = ""
    issued_at: Timestamp | float | None = None


class _CustomScheduled(_Custom, frozen=True, kw_only=True, tag="maintenance_scheduled"):
    window_start: Timestamp | float | None = None
    window_end: Timestamp | float | None = None
    can_reschedule: bool = False


class _CustomStarted(_Custom, frozen=True, kw_only=True, tag="maintenance_started"):
    pass


class _CustomCompleted(_Custom, frozen=True, kw_only=True, tag="maintenance_completed"):
    pass


class _CustomPreempted(_Custom, frozen=True, kw_only=True, tag="preempted"):
    pass


class _CustomHostError(_Custom, frozen=True, kw_only=True, tag="host_error"):
    pass


_custom_decoder = msgspec.json.Decoder(
    _CustomScheduled | _CustomStarted | _CustomCompleted | _CustomPreempted | _CustomHostError
)


def parse_custom(data: bytes, *, message_id: str = "") -> list[ParsedNotice]:
    """Parse a notice in our own format (:data:`CUSTOM_FORMAT`; see the module docstring).

    Raises:
        NoticeMalformed: not JSON, an unknown ``event``, an unknown field, or a value of the wrong type.
    """
    try:
        notice = _custom_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise _malformed(exc, "custom notice") from exc
    common: dict[str, Any] = {"instance": notice.instance, "message_id": message_id, "source": "custom"}
    event: Notice
    match notice:
        case _CustomScheduled():
            start, end = _epoch(notice.window_start), _epoch(notice.window_end)
            if start is not None and end is not None and end < start:
                raise NoticeMalformed(f"custom notice: window_end {end} before window_start {start} at `$.window_end`")
            event = MaintenanceScheduled(
                kind=notice.kind or "SCHEDULED",
                window_start=start,
                window_end=end,
                can_reschedule=notice.can_reschedule,
                **common,
            )
        case _CustomStarted():
            event = MaintenanceStarted(kind=notice.kind, **common)
        case _CustomCompleted():
            event = MaintenanceCompleted(kind=notice.kind, **common)
        case _CustomPreempted():
            event = Preempted(kind=notice.kind or "PREEMPTED", **common)
        case _CustomHostError():
            event = HostError(kind=notice.kind or "HOST_ERROR", **common)
    return [ParsedNotice(event=event, identities=(notice.instance,), issued_at=_epoch(notice.issued_at))]


# --- the metadata server's instance/upcoming-maintenance ---------------------------------------------------


class _Upcoming(msgspec.Struct, frozen=True):
    type: str = ""
    window_start_time: Timestamp | None = None
    window_end_time: Timestamp | None = None
    latest_window_start_time: Timestamp | None = None
    can_reschedule: bool | str | None = None
    maintenance_status: str = ""


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


def parse_upcoming_maintenance(body: bytes, *, instance: str, message_id: str = "") -> list[ParsedNotice]:
    """Parse the metadata server's ``instance/upcoming-maintenance`` JSON (snake_case or camelCase fields).

    An empty object means no maintenance is announced and parses to an empty list.

    Raises:
        NoticeMalformed: not a JSON object, or a field of the wrong type (the path is named).
    """
    try:
        raw = msgspec.json.decode(body)
    except msgspec.MsgspecError as exc:
        raise _malformed(exc, "upcoming-maintenance") from exc
    if not isinstance(raw, dict):
        raise NoticeMalformed(f"upcoming-maintenance: expected a JSON object, got {type(raw).__name__} at `$`")
    if not raw:
        return []
    try:
        upcoming = msgspec.convert({_snake(k): v for k, v in raw.items()}, _Upcoming)
    except msgspec.MsgspecError as exc:
        raise _malformed(exc, "upcoming-maintenance") from exc
    common: dict[str, Any] = {
        "instance": instance,
        "message_id": message_id,
        "source": "metadata",
        "kind": upcoming.type or "SCHEDULED",
    }
    event: Notice
    if upcoming.maintenance_status.upper() == "ONGOING":
        event = MaintenanceStarted(**common)
    else:
        event = MaintenanceScheduled(
            window_start=_epoch(upcoming.window_start_time),
            window_end=_epoch(upcoming.window_end_time),
            can_reschedule=_flag(upcoming.can_reschedule),
            **common,
        )
    return [ParsedNotice(event=event, identities=(instance,))]


# --- dispatch ---------------------------------------------------------------------------------------------


def parse_message(data: bytes, attributes: Mapping[str, str], *, message_id: str = "") -> list[ParsedNotice]:
    """Parse one Pub/Sub message in any of the three formats, told apart by shape.

    Raises:
        NoticeMalformed: the message is in none of the formats, or is malformed in the one it claims.
    """
    if "type_url" in attributes:
        return parse_gke_notification(attributes, message_id=message_id)
    try:
        head = msgspec.json.decode(data)
    except msgspec.MsgspecError as exc:
        raise _malformed(exc, "Pub/Sub message") from exc
    if isinstance(head, dict):
        if "protoPayload" in head:
            return parse_log_entry(data, message_id=message_id)
        if "format" in head:
            return parse_custom(data, message_id=message_id)
    raise NoticeMalformed(
        "Pub/Sub message: not a Cloud Logging entry (`$.protoPayload`), a GKE notification (attribute "
        f"`type_url`) or a custom notice (`$.format` = {CUSTOM_FORMAT!r})"
    )
