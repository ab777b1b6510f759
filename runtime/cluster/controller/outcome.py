"""The run's outcome (``LaunchResult``) as its events tell it: each generation's size and strategy
(``GroupFormed``), each recovery (``RecoveryCompleted``), the step a resumed run went on from. The supervisor
decides and publishes; it writes no result (the shell copies its count of restarted survivors at the end)."""

from __future__ import annotations

from typing import Any

from elastic_runtime.cluster.config import LaunchResult
from elastic_runtime.core.events import Event, GroupFormed, RecoveryCompleted

__all__ = ["Outcome"]


class Outcome:
    """Fills ``result`` in from the run's events, in publish order (:meth:`take`, subscribed to the bus)."""

    def __init__(self, result: LaunchResult) -> None:
        self.result = result
        self._strategy = ""  # of the newest generation: the strategy of the recovery it ends

    def take(self, event: Event) -> None:
        result = self.result
        match event:
            case GroupFormed(members=members, strategy=strategy, restore_step=step):
                result.world_size_history.append(len(members))
                result.strategies.append(strategy)
                self._strategy = strategy
                if strategy == "start":
                    result.resumed_from = step if step > 0 else -1
            case RecoveryCompleted():
                result.recoveries.append(recovery(event, self._strategy))

    async def on_event(self, event: Event, ctx: object) -> None:
        self.take(event)


def recovery(event: RecoveryCompleted, strategy: str) -> dict[str, Any]:
    """One recovery as ``LaunchResult.recoveries`` lists it."""
    return {
        "cause": event.cause,
        "strategy": strategy,
        "recovery_s": event.recovery_s,
        "lost_steps": event.lost_steps,
        "restored_from": event.restored_from,
        "failed_step": event.failed_step,
        "bytes_by_tier": event.bytes_by_tier,
        "read_s_by_tier": event.read_s_by_tier,
        "transfer_s": event.transfer_s,
    }
