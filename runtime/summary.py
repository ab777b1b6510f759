"""Run summaries computed from the event log: steps, failures and their recovery, mesh history, goodput."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.events import (
    Event,
    MeshChanged,
    RecoveryCompleted,
    RunFinished,
    RunStarted,
    StepCompleted,
)


def productive_seconds(events: Sequence[Event]) -> float:
    """Time spent in steps that count: for each step number only its last commit (earlier ones were redone)."""
    last_commit: dict[int, float] = {}
    for event in events:
        if isinstance(event, StepCompleted) and event.step is not None:
            last_commit[event.step] = event.duration_s
    return sum(last_commit.values())


def summarize(events: Sequence[Event]) -> dict[str, Any]:
    """The figures of one run, as plain JSON-ready values.

    ``goodput`` is productive step time over the wall time from RunStarted to RunFinished; start-up before
    the first step (JAX initialisation, the first compile) counts against it.
    """
    started = next((e for e in events if isinstance(e, RunStarted)), None)
    finished = next((e for e in reversed(events) if isinstance(e, RunFinished)), None)
    steps = [e for e in events if isinstance(e, StepCompleted)]
    wall = (finished.mono_time - started.mono_time) if started and finished else 0.0
    mesh_history: list[dict[str, Any]] = []
    if started is not None:
        mesh_history.append({"step": 0, "shape": started.mesh_shape, "reason": "start"})
    mesh_history += [
        {"step": e.step, "shape": e.new_shape, "reason": e.reason} for e in events if isinstance(e, MeshChanged)
    ]
    failures = [
        {
            "kind": e.cause,
            "step": e.failed_step,
            "recovery_s": round(e.recovery_s, 4),
            "lost_steps": e.lost_steps,
            "restored_from": e.restored_from,
            "mesh_after": e.mesh_shape,
        }
        for e in events
        if isinstance(e, RecoveryCompleted)
    ]
    productive = productive_seconds(events)
    return {
        "ok": bool(finished and finished.ok),
        "steps_completed": steps[-1].step if steps else 0,
        "final_loss": steps[-1].loss if steps else None,
        "failures": failures,
        "mesh_history": mesh_history,
        "wall_s": round(wall, 3),
        "productive_s": round(productive, 3),
        "goodput": round(productive / wall, 4) if wall > 0 else None,
    }
