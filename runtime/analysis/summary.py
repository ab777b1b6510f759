"""Run summaries computed from the event log: steps, failures and their recovery, mesh history, goodput."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from elastic_runtime.analysis.goodput import goodput, restored_tiers
from elastic_runtime.core.events import (
    CorruptionHealed,
    Event,
    MeshChanged,
    RecoveryCompleted,
    RunFinished,
    RunStarted,
    SilentCorruption,
    StepCompleted,
)


def summarize(events: Sequence[Event]) -> dict[str, Any]:
    """The figures of one run, as plain JSON-ready values.

    ``goodput`` is productive step time over the wall time from RunStarted to RunFinished; start-up before
    the first step (the first compile) counts against it. ``badput_s`` says where the rest went
    (see :mod:`elastic_runtime.analysis.goodput`).
    """
    started = next((e for e in events if isinstance(e, RunStarted)), None)
    finished = next((e for e in reversed(events) if isinstance(e, RunFinished)), None)
    steps = [e for e in events if isinstance(e, StepCompleted)]
    accounting = goodput(events)
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
            "tiers": restored_tiers(e),
            "transfer_s": e.transfer_s,
        }
        for e in events
        if isinstance(e, RecoveryCompleted)
    ]
    return {
        "ok": bool(finished and finished.ok),
        "steps_completed": steps[-1].step if steps else 0,
        "final_loss": steps[-1].loss if steps else None,
        "failures": failures,
        "mesh_history": mesh_history,
        "wall_s": round(accounting.wall_s, 3),
        "productive_s": round(accounting.productive_s, 3),
        "goodput": None if accounting.goodput is None else round(accounting.goodput, 4),
        "badput_s": {k: round(v, 3) for k, v in accounting.badput_s.items() if v > 0},
    }


def corruption_summary(events: Sequence[Event], injected_at: int) -> dict[str, Any]:
    """What the fingerprints found and how the run healed (the demos' JSON ``corruption``)."""
    found = [e for e in events if isinstance(e, SilentCorruption)]
    healed = [e for e in events if isinstance(e, CorruptionHealed)]
    recovered = [e for e in events if isinstance(e, RecoveryCompleted) and e.cause == "SilentCorruption"]
    return {
        "injected_after_step": injected_at,
        "detected_step": found[0].step if found else None,
        "suspects": list(found[0].suspects) if found else [],
        "attributed": found[0].attributed if found else None,
        "kind": healed[-1].kind if healed else None,
        "evicted": list(healed[-1].evicted) if healed else [],
        "lost_steps": sum(e.lost_steps for e in recovered),
        "healed_s": round(healed[-1].seconds, 3) if healed else None,
    }
