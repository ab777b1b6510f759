"""Live progress for the demos: committed steps now and then, every other event as it happens."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

from elastic_runtime.core import events as ev

__all__ = ["ProgressPrinter", "describe"]


class ProgressPrinter:
    """A handler for every event: prints steps now and then, and every other event as it happens."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self._last = 0.0

    async def __call__(self, event: Any, ctx: Any) -> None:
        if isinstance(event, ev.StepCompleted):
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            self._last = now
            loss = "-" if event.loss is None else f"{event.loss:8.5f}"
            shape = "x".join(f"{k}={v}" for k, v in event.mesh_shape.items())
            devices = int(np.prod(list(event.mesh_shape.values())))
            print(
                f"  step {event.step:5d}  loss {loss:>8}  mesh {shape} ({devices} devices)  "
                f"{event.duration_s * 1000:6.1f} ms/step",
                flush=True,
            )
            return
        print(f"  >> {describe(event)}", flush=True)


def describe(event: Any) -> str:
    """One line for a non-step event."""
    name = type(event).__name__
    match event:
        case ev.SliceLost():
            lost = f"slices {list(event.slices)} (devices {list(event.devices)})"
            return f"{name} at step {event.step}: {lost}, {event.status}"
        case ev.DeviceLost():
            return f"{name} at step {event.step}: devices {list(event.devices)}, {event.status}"
        case ev.MeshChanged():
            return f"{name}: {event.old_shape} -> {event.new_shape} ({event.reason})"
        case ev.StateRestored():
            took = f"in {event.seconds:.3f} s, lost {event.lost_steps}"
            return f"{name}: step {event.step} from {event.restored_from} {took}"
        case ev.RecoveryCompleted():
            return (
                f"{name}: step {event.step} committed {event.recovery_s:.3f} s after the failure, "
                f"lost {event.lost_steps} step(s)"
            )
        case ev.Failure():
            return f"{name} at step {event.step}: {event.error_type} {event.message}"
    fields = {k: v for k, v in _fields(event).items() if k not in ("wall_time", "mono_time", "source")}
    return f"{name} {fields}"


def _fields(event: Any) -> dict[str, Any]:
    return dict(msgspec.structs.asdict(event))
