"""Stop a recovery that cannot finish: a recovery handler that failed aborts it with the handler's error."""

from __future__ import annotations

from runtime.context import RuntimeContext
from runtime.events import HandlerFailed


async def abort_recovery_on_handler_failure(event: HandlerFailed, ctx: RuntimeContext) -> None:
    """On HandlerFailed during a recovery: abort, so the run ends with a clear error instead of waiting."""
    if ctx.recovering:
        kind = "timed out" if event.timed_out else f"raised {event.error_type}"
        ctx.abort(f"handler {event.handler} {kind} on {event.event_type}: {event.message}")
