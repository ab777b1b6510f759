"""Built-in handlers, written with exactly the API a user's handler has."""

from elastic_runtime.handlers.integrity import heal_silent_corruption
from elastic_runtime.handlers.maintenance import (
    DrainScheduler,
    checkpoint_on_notice,
    checkpoint_on_preemption,
    drain_on_start,
    plan_drain,
)
from elastic_runtime.handlers.remesh import remesh_on_device_loss
from elastic_runtime.handlers.restore import restore_after_remesh
from elastic_runtime.handlers.retry import wait_for_mesh
from elastic_runtime.handlers.scale_up import scale_up

__all__ = [
    "DrainScheduler",
    "checkpoint_on_notice",
    "checkpoint_on_preemption",
    "drain_on_start",
    "heal_silent_corruption",
    "plan_drain",
    "remesh_on_device_loss",
    "restore_after_remesh",
    "scale_up",
    "wait_for_mesh",
]

if __name__ != "elastic_runtime.handlers":  # this file run under its old import name, `handlers` (compat/old_names.py)
    from elastic_runtime.compat.old_names import redirect

    redirect(__name__)
