"""Scale up when devices come back: move the live state onto the larger mesh at the next step boundary."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from elastic_runtime.core.events import ScaleUpAvailable

if TYPE_CHECKING:
    from elastic_runtime.core.context import RuntimeContext


async def scale_up(event: ScaleUpAvailable, ctx: RuntimeContext) -> None:
    """On ScaleUpAvailable: re-mesh onto the healthy devices if that gives a larger mesh than now."""
    if ctx.recovering:
        return  # the recovery in progress builds its mesh from the healthy devices anyway
    mesh = ctx.policy.fit(await ctx.healthy_devices())
    current = ctx.mesh
    if current is None or math.prod(mesh.devices.shape) > math.prod(current.devices.shape):
        ctx.remesh(mesh, reason=f"scale-up: {len(event.devices)} healthy devices")
