"""Built-in handlers, written with exactly the API a user's handler has."""

from handlers.maintenance import (
    DrainScheduler,
    checkpoint_on_notice,
    checkpoint_on_preemption,
    drain_on_start,
    plan_drain,
)
from handlers.remesh import remesh_on_device_loss
from handlers.restore import restore_after_remesh
from handlers.retry import wait_for_mesh
from handlers.scale_up import scale_up

__all__ = [
    "DrainScheduler",
    "checkpoint_on_notice",
    "checkpoint_on_preemption",
    "drain_on_start",
    "plan_drain",
    "remesh_on_device_loss",
    "restore_after_remesh",
    "scale_up",
    "wait_for_mesh",
]
