"""The durable checkpoints' commits, in the shell: each writer's part (``Saved``) is added as it comes in, and a
step whose parts are all in is committed by its own task, apart from the reading of messages (a commit takes
seconds in GCS; awaited where messages are read it held back the heartbeats).
"""

from __future__ import annotations

import logging

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from elastic_runtime.cluster.controller.processes import WorkerProcess
from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.cluster.protocol import DurableCommitted, Saved
from elastic_runtime.core.errors import CheckpointInvalid, StorageError
from elastic_runtime.core.events import CheckpointFailed

__all__ = ["add_saved", "commit", "commit_durable", "not_committed"]

log = logging.getLogger(__name__)


async def add_saved(controller: ControllerState, proc: WorkerProcess, saved: Saved) -> None:
    """A writer's part of a durable checkpoint; the step is committed once every writer's part is in."""
    assert controller.durable is not None
    if proc.worker not in controller.members:
        return
    try:
        step = controller.durable.add(saved, controller.members.index(proc.worker))
    except (CheckpointInvalid, StorageError) as exc:
        await not_committed(controller, saved.step, exc)
        return
    if step is not None and controller.to_commit is not None:
        controller.commits_pending += 1
        controller.to_commit.send_nowait(step)


async def commit_durable(controller: ControllerState, queue: MemoryObjectReceiveStream[int]) -> None:
    """Commit each durable step whose parts are all in, in order, apart from the reading of messages."""
    async for step in queue:
        try:
            await commit(controller, step)
        finally:
            controller.commits_pending -= 1
            controller.changes.tell()


async def not_committed(controller: ControllerState, step: int, exc: Exception) -> None:
    log.error("controller: durable checkpoint of step %d not committed: %s", step, exc)
    await controller.bus.publish(CheckpointFailed(step=step, source="controller", tier="durable", reason=str(exc)))


async def commit(controller: ControllerState, step: int) -> None:
    assert controller.durable is not None
    try:
        committed = await anyio.to_thread.run_sync(controller.durable.commit, step)
    except (CheckpointInvalid, StorageError) as exc:
        await not_committed(controller, step, exc)
        return
    controller.durable_newest = max(controller.durable_newest, step)
    for worker in controller.members:  # their replicas pinned for older durable steps may go
        await controller.server.send(controller.pool[worker], DurableCommitted(step=step))
    await controller.bus.publish(committed)
