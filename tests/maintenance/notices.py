"""Notices as Google Cloud (and our users) publish them, for tests and benchmarks."""

from __future__ import annotations

import json
import time
from typing import Any


def rfc3339(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1e6):06d}Z"


def log_entry(
    method: str,
    *,
    name: str = "worker-0",
    instance_id: str = "4711",
    metadata: dict[str, Any] | None = None,
    issued: float | None = None,
    status_message: str = "",
    operation: dict[str, Any] | None = None,
) -> bytes:
    """A Cloud Logging sink message: a Compute Engine system-event audit LogEntry, as JSON."""
    payload: dict[str, Any] = {
        "@type": "type.googleapis.com/google.cloud.audit.AuditLog",
        "serviceName": "compute.googleapis.com",
        "methodName": f"compute.instances.{method}",
        "resourceName": f"projects/elastic-test/zones/us-central2-b/instances/{name}",
        "authenticationInfo": {"principalEmail": "system@google.com"},
        "requestMetadata": {"callerIp": "0.0.0.0", "callerSuppliedUserAgent": "GCE"},
    }
    if metadata is not None:
        payload["metadata"] = metadata
    if status_message:
        payload["status"] = {"message": status_message}
    entry: dict[str, Any] = {
        "protoPayload": payload,
        "insertId": "-abc123",
        "resource": {
            "type": "gce_instance",
            "labels": {"instance_id": instance_id, "project_id": "elastic-test", "zone": "us-central2-b"},
        },
        "timestamp": rfc3339(time.time() if issued is None else issued),
        "severity": "NOTICE",
        "logName": "projects/elastic-test/logs/cloudaudit.googleapis.com%2Fsystem_event",
        "receiveTimestamp": rfc3339(time.time()),
    }
    if operation is not None:
        entry["operation"] = operation
    return json.dumps(entry).encode()


def upcoming(
    *,
    name: str = "worker-0",
    start: float,
    end: float,
    status: str = "PENDING",
    issued: float | None = None,
    can_reschedule: bool = True,
    **kwargs: Any,
) -> bytes:
    metadata = {
        "type": "SCHEDULED",
        "canReschedule": can_reschedule,
        "windowStartTime": rfc3339(start),
        "windowEndTime": rfc3339(end),
        "latestWindowStartTime": rfc3339(start),
        "maintenanceStatus": status,
    }
    return log_entry("upcomingMaintenance", name=name, metadata=metadata, issued=issued, **kwargs)


def gke(kind: str, payload: dict[str, Any], *, cluster: str = "train") -> dict[str, str]:
    """The attributes of a GKE cluster notification (its data is only a summary for people)."""
    return {
        "cluster_location": "us-central1",
        "cluster_name": cluster,
        "project_id": "elastic-test",
        "type_url": f"type.googleapis.com/google.container.v1beta1.{kind}",
        "payload": json.dumps(payload),
    }


def custom(event: str, instance: str, **fields: Any) -> bytes:
    return json.dumps({"format": "elastic-runtime.notice/v1", "event": event, "instance": instance, **fields}).encode()
