"""The docs say what the code has: docs/events.md is exactly the catalogue generated from the event classes.

Regenerate it after changing an event: ``.venv/bin/python tests/test_docs.py > docs/events.md``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import msgspec

import runtime
import runtime.core.events as ev

ROOT = Path(__file__).resolve().parent.parent

GROUPS: list[tuple[str, ModuleType, list[str]]] = [
    ("Run progress", ev, ["RunStarted", "RunFinished", "StepCompleted"]),
    ("Failures (all derive from `Failure`)", ev, [
        "Failure", "StepFailed", "DeviceLost", "SliceLost", "ProcessLost", "WorkerLost", "WorkerHung",
        "MalformedHeartbeat", "ConnectionRefused", "HandlerFailed", "CheckpointFailed", "CheckpointCorrupt",
        "MalformedNotice", "RecoveryFailed", "DataMismatch",
    ]),
    ("Conditions", ev, ["Straggler", "MeshReduced"]),
    ("Maintenance notices (all derive from `Notice`)", ev, [
        "Notice", "MaintenanceScheduled", "MaintenanceStarted", "MaintenanceCompleted", "Preempted", "HostError",
    ]),
    ("Checkpoints", ev, ["CheckpointStarted", "CheckpointCommitted", "CheckpointSkipped", "ReplicaSkipped"]),
    ("Recovery", ev, [
        "RecoveryStarted", "MeshChanged", "StateRestored", "RecoveryCompleted", "ScaleUpAvailable", "StateTransformed",
        "MeshReady",
    ]),
    ("Requests", ev, ["SaveCheckpoint", "Drain"]),
    ("Multi-process groups (logged by the controller)", ev, [
        "WorkerStarted", "WorkerExited", "WorkerKilled", "GroupForming", "GroupFormed",
    ]),
]  # fmt: skip

INTRO = """# Event catalogue

Every event is a frozen, keyword-only `msgspec.Struct` deriving from `Event`, all defined in
`runtime/core/events.py`. Each carries `wall_time`
(epoch s), `mono_time` (monotonic s), `step` (where known) and `source`; the JSON tag `type` is the class
name. Facts are in the past tense, requests in the imperative. Subscribing to a base class (`Failure`,
`DeviceLost`, `Notice`, `Event`) delivers its subclasses too. Your own subclasses of `Event` are logged and
read back like these once their module is imported.

This page is generated from the classes' docstrings and fields by `tests/test_docs.py`, which also checks
that it is up to date.
"""


def render_catalogue() -> str:
    base = {f.name for f in msgspec.structs.fields(ev.Event)}
    lines = [INTRO]
    for title, module, names in GROUPS:
        lines += [f"## {title}", "", "| event | fields | meaning |", "| --- | --- | --- |"]
        for name in names:
            cls = getattr(module, name)
            parent = cls.__mro__[1]
            inherited = set() if parent is ev.Event else {f.name for f in msgspec.structs.fields(parent)}
            own = [f"`{f.name}`" for f in msgspec.structs.fields(cls) if f.name not in base | inherited]
            origin = "" if parent is ev.Event else f"({parent.__name__}) "
            doc = " ".join((cls.__doc__ or "").split()).replace("|", "\\|")
            lines.append(f"| `{name}` | {origin}{', '.join(own) or '-'} | {doc} |")
        lines.append("")
    return "\n".join(lines)


def test_every_public_event_is_in_a_group() -> None:
    grouped = {name for _, _, names in GROUPS for name in names}
    public = {
        name
        for name in runtime.__all__
        if isinstance(getattr(runtime, name), type) and issubclass(getattr(runtime, name), ev.Event)
    }
    assert public - grouped == {"Event"}


def test_the_catalogue_is_up_to_date() -> None:
    assert (ROOT / "docs" / "events.md").read_text() == render_catalogue(), (
        "docs/events.md is stale: .venv/bin/python tests/test_docs.py > docs/events.md"
    )


if __name__ == "__main__":
    print(render_catalogue(), end="")
