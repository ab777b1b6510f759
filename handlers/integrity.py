"""Heal silent data corruption: a transient divergence is replayed, a persistent one's devices are evicted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_runtime.core.errors import MeshUnavailable
from elastic_runtime.core.events import SilentCorruption
from elastic_runtime.handlers.retry import wait_for_mesh

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from elastic_runtime.core.context import RuntimeContext


async def heal_silent_corruption(event: SilentCorruption, ctx: RuntimeContext) -> None:
    """On SilentCorruption: go back to the newest verified state (the RAM tier falls back to it) and replay.

    A transient one (a flipped bit) is gone in the replay: ``CorruptionHealed`` says so when the step agrees. A
    persistent one (it came back in the replay, or its devices were suspects before) is faulty hardware: its
    devices are cordoned and the mesh is rebuilt without them, as after a lost device (``restore_after_remesh``
    restores and resumes on ``MeshChanged``).
    """
    if not event.persistent:
        ctx.restore("latest")
        ctx.resume(reason=f"replaying step {event.step} from the newest verified state")
        return
    ctx.cordon(event.suspects)

    async def fit() -> Mesh:
        return ctx.policy.fit(await ctx.healthy_devices())

    try:
        mesh = await wait_for_mesh(fit, wait_s=ctx.config.device_wait_s, poll_s=ctx.config.device_poll_s)
    except MeshUnavailable as exc:
        ctx.abort(f"no mesh without the devices that compute wrong, {list(event.suspects)}: {exc}")
        return
    ctx.remesh(mesh, reason=f"devices {list(event.suspects)} compute wrong (SilentCorruption at step {event.step})")
