"""Re-mesh after lost devices: build the largest allowed mesh over the healthy devices."""

from __future__ import annotations

from jax.sharding import Mesh

from handlers.retry import wait_for_mesh
from runtime.context import RuntimeContext
from runtime.events import DeviceLost


async def remesh_on_device_loss(event: DeviceLost, ctx: RuntimeContext) -> None:
    """On DeviceLost (and SliceLost): wait for a mesh the policy allows, then ask the executor to use it.

    Raises MeshUnavailable (which aborts the recovery) when no mesh fits within ``device_wait_s``.
    """

    async def fit() -> Mesh:
        return ctx.policy.fit(await ctx.healthy_devices())

    mesh = await wait_for_mesh(fit, wait_s=ctx.config.device_wait_s, poll_s=ctx.config.device_poll_s)
    ctx.remesh(mesh, reason=f"{type(event).__name__} at step {event.step}: devices {list(event.devices)}")
