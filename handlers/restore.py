"""Restore after a re-mesh that lost the live state, then resume training."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_runtime.core.events import MeshChanged

if TYPE_CHECKING:
    from elastic_runtime.core.context import RuntimeContext


async def restore_after_remesh(event: MeshChanged, ctx: RuntimeContext) -> None:
    """On MeshChanged with ``needs_restore``: restore the newest snapshot onto the new mesh and resume."""
    if event.needs_restore:
        ctx.restore("latest")
        ctx.resume(reason=f"restored after {event.reason}")
