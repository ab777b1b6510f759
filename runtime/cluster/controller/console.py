"""The group's progress on the controller's console: what the run is waiting for while it starts, the steps now
and then, and a line for every lost worker, re-forming, recovery and mesh change, in the words of a run in one
process (``elastic_runtime.core.progress``). Off with ``launch --quiet`` (``LaunchConfig.progress``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO, Any

import anyio

from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.events import (
    Event,
    Failure,
    GroupFormed,
    GroupForming,
    RunFinished,
    RunStarted,
    StepCompleted,
    WorkerKilled,
)
from elastic_runtime.core.progress import describe_event, describe_mesh, describe_metrics, say
from elastic_runtime.faults.process import FAULT_INJECTION

__all__ = ["GroupConsole"]

EVERY_S = 10.0  # between two lines about steps, and two about a slow start


class GroupConsole:
    """Prints the group's progress (see the module's docstring).

    Args:
        waiting: what the first group is waiting for, asked every ``EVERY_S`` until it forms (connected workers,
            joined ones, the ones still starting), or None when there is nothing to say.
        out: where the lines go (stderr by default).
    """

    def __init__(self, waiting: Callable[[], str | None], out: IO[str] | None = None) -> None:
        self.waiting = waiting
        self.out = out
        self.created = time.monotonic()
        self.started = 0.0  # when the first group formed (RunStarted)
        self.target = 0
        self.productive_s = 0.0
        self._shown = 0  # the step of the newest line about steps
        self._shown_at = 0.0
        self._members = 0

    def attach(self, bus: EventBus) -> None:
        bus.subscribe(Event, self.on_event, priority=-(10**8), timeout=None)

    def say(self, text: str) -> None:
        say(text, self.out)

    async def run(self) -> None:
        """Until the first group forms: a line every ``EVERY_S`` on what it waits for (a real model's imports
        and first compile take minutes)."""
        while not self.started:
            await anyio.sleep(EVERY_S)
            why = self.waiting() if not self.started else None
            if why:
                self.say(f"{time.monotonic() - self.created:.0f} s: {why}")

    async def on_event(self, event: Event, ctx: Any) -> None:
        match event:
            case StepCompleted():
                self.productive_s += event.duration_s
                now = time.monotonic()
                step = event.step or 0
                if self._shown and now - self._shown_at < EVERY_S and step < self.target:
                    return
                self._steps(step, event, now)
            case RunStarted():
                self.started, self.target = time.monotonic(), event.target_steps
                self._shown_at = self.started
                self.say(f"training to step {event.target_steps} on mesh {describe_mesh(event.mesh_shape)}")
            case GroupForming() if event.strategy != "start":
                why = f": {event.reason}" if event.reason else ""
                self.say(
                    f"re-forming the group ({event.strategy}): {len(event.members)} workers, generation "
                    f"{event.generation}{why}"
                )
            case GroupFormed():
                self._members = len(event.members)
                which = "the first group" if event.strategy == "start" else f"generation {event.generation}"
                self.say(
                    f"{which} formed: {len(event.members)} workers in {event.seconds:.1f} s, "
                    f"restoring step {event.restore_step}"
                )
            case RunFinished():
                wall = time.monotonic() - (self.started or self.created)
                end = "finished" if event.ok else f"ended: {event.reason}"
                self.say(f"{end} at step {event.step} after {wall:.1f} s")
            case WorkerKilled(reason=reason) if reason.startswith(FAULT_INJECTION):
                # A --fault names a process of the group; every other line names worker ids: this one says both.
                self.say(reason)
            case Failure(source=source) if source.startswith("handlers@"):
                return  # a worker's handler failed: in the log, as the user's own
            case _:
                line = describe_event(event)
                if line is not None:
                    worker = getattr(event, "worker", None)
                    self.say(line if worker is None else f"worker {worker}: {line}")

    def _steps(self, step: int, event: StepCompleted, now: float) -> None:
        steps = step - self._shown
        per_step = (now - self._shown_at) / steps * 1000 if steps > 0 else 0.0
        self._shown, self._shown_at = step, now
        wall = now - self.started
        goodput = f"  goodput {100 * min(self.productive_s / wall, 1.0):.1f}%" if wall > 0 else ""
        metrics = describe_metrics(event.metrics) or ("" if event.loss is None else f"loss {event.loss:.5g}")
        self.say(
            f"step {step}/{self.target}  {metrics}  {per_step:.1f} ms/step  {self._members} workers, "
            f"mesh {describe_mesh(event.mesh_shape)}{goodput}"
        )
