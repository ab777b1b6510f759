"""Re-mesh after lost devices: build the largest allowed mesh over the healthy devices."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_runtime.core.errors import MeshUnavailable
from elastic_runtime.core.events import DeviceLost
from elastic_runtime.handlers.retry import wait_for_mesh

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from elastic_runtime.core.context import RuntimeContext


async def remesh_on_device_loss(event: DeviceLost, ctx: RuntimeContext) -> None:
    """On DeviceLost (and SliceLost): wait for a mesh the policy allows, then ask the executor to use it.

    When no mesh fits within ``device_wait_s``, the recovery is aborted with the policy's explanation.
    """

    async def fit() -> Mesh:
        return ctx.policy.fit(await ctx.healthy_devices())

    try:
        mesh = await wait_for_mesh(fit, wait_s=ctx.config.device_wait_s, poll_s=ctx.config.device_poll_s)
    except MeshUnavailable as exc:
        ctx.abort(f"after waiting {ctx.config.device_wait_s} s for devices: {exc}")
        return
    ctx.remesh(mesh, reason=f"{type(event).__name__} at step {event.step}: devices {list(event.devices)}")
