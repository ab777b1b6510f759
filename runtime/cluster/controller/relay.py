"""The controller's half of the script's own handlers under ``launch``: the group's events go to the workers.

The controller is the one place where the group's events exist once (a lost worker, a re-forming, a restore).
The handlers a training script registers on its ``ElasticRuntime`` run in every worker
(``runtime/cluster/worker/boundary.py``), so the relay forwards to every member each event whose type the
script subscribes to (its workers name those types in ``Hello.events``), numbered (``Notify.seq``) and
addressed to one generation of the group: the members of that generation run it at one step boundary they
agree on, so a ``ctx.transform_state`` changes every process's shards at the same step.

Which generation: an event of a group that is up goes to that group. From a member's loss (or a
``RecoveryStarted``, a ``GroupForming``) until the next ``GroupFormed`` the old group is broken (its members
leave it without another step boundary), so events are held and sent to the group that forms next, just
after its ``RestoreStep``: the script's handlers see the failure, the re-forming and the restore, each once per
process, in the new group.

The relay subscribes after every other handler (lowest priority), so it sees each event once it is
dispatched, in publish order. It also carries out what the workers' handlers ask of the controller
(``Requested``: ``abort``, once however many processes ask) and publishes the events they publish.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.cluster.protocol import Notify, Published, Requested
from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.errors import ConfigError, RecoveryError
from elastic_runtime.core.eventlog import decode_event, encode_event
from elastic_runtime.core.events import (
    Event,
    GroupFormed,
    GroupForming,
    RecoveryStarted,
    RunFinished,
    WorkerHung,
    WorkerLost,
)

__all__ = ["SOURCE_PREFIX", "EventRelay"]

log = logging.getLogger(__name__)

# The source of an event a worker's handlers published: never forwarded back to the workers.
SOURCE_PREFIX = "handlers@worker-"
# Events held while the group re-forms, at most (a re-forming publishes a handful).
_MAX_HELD = 1024


class EventRelay:
    """Forwards the group's events to the workers whose script subscribes to them; see the module's docstring."""

    def __init__(self, controller: ControllerState) -> None:
        self._c = controller
        self._seq = 0
        self._holding = True  # until the first group is formed
        self._held: list[Event] = []
        self._generation = -1
        self._members: tuple[int, ...] = ()
        self._wanted: frozenset[str] = frozenset()  # the event types the members' scripts subscribe to
        self._acted: set[tuple[int, str]] = set()  # (seq, kind) of the requests carried out
        self.sent = 0  # notifications sent, every member counted

    def attach(self, bus: EventBus) -> None:
        bus.subscribe(Event, self.forward, priority=-(10**9), timeout=None)

    async def forward(self, event: Event, ctx: Any) -> None:
        if event.source.startswith(SOURCE_PREFIX) or isinstance(event, RunFinished):
            return  # the workers' own, or the end: the workers are stopped before it
        if isinstance(event, RecoveryStarted | GroupForming) or (
            isinstance(event, WorkerLost | WorkerHung) and event.worker in self._members
        ):
            self._holding = True
        if isinstance(event, GroupFormed):
            self._holding, self._generation, self._members = False, event.generation, event.members
            self._check_alike(event.members)
            # Once per group, not per event: at thousands of members a union per event was O(N) each.
            hellos = (self._c.pool[w].hello for w in event.members if w in self._c.pool.procs)
            self._wanted = frozenset(name for hello in hellos if hello is not None for name in hello.events)
            held, self._held = self._held, []
            for earlier in held:
                await self._send(earlier)
        if self._holding:
            if len(self._held) < _MAX_HELD:
                self._held.append(event)
            else:
                log.warning(
                    "controller: %s not forwarded to the workers' handlers: too many held", type(event).__name__
                )
            return
        await self._send(event)

    def _check_alike(self, members: tuple[int, ...]) -> None:
        """Members whose scripts differ in having handlers at all would not all join the boundary's all-gather
        (``worker_handlers.py``): the group would hang at its first step. End the run, saying why."""
        hellos = {w: self._c.pool[w].hello for w in members if w in self._c.pool.procs}
        with_handlers = {w for w, hello in hellos.items() if hello is not None and hello.events}
        if with_handlers and len(with_handlers) < len(members):
            self._c.end(
                ConfigError(
                    f"workers {sorted(with_handlers)} run a script with handlers and workers "
                    f"{sorted(set(members) - with_handlers)} one without: every worker must run the same script"
                )
            )

    async def _send(self, event: Event) -> None:
        if not any(cls.__name__ in self._wanted for cls in type(event).__mro__):
            return
        self._seq += 1
        notify = Notify(seq=self._seq, generation=self._generation, event=msgspec.Raw(encode_event(event)))
        for worker in self._members:
            await self._c.server.send(self._c.pool[worker], notify)
            self.sent += 1

    # --- what the workers' handlers ask -----------------------------------------------------------------

    async def requested(self, message: Requested) -> None:
        """A request of the script's handlers: carried out once per notification, whoever asks first."""
        if (message.seq, message.kind) in self._acted:
            return
        self._acted.add((message.seq, message.kind))
        if message.kind == "abort":
            log.error("controller: the script's handlers abort the run: %s", message.reason)
            self._c.end(
                RecoveryError(
                    f"aborted by a handler of the training script (worker {message.worker}): {message.reason}",
                    last_committed_step=self._c.group_step,
                )
            )
        else:
            log.error("controller: unknown request %r from worker %d ignored", message.kind, message.worker)

    async def published(self, message: Published) -> None:
        """An event the lead process's handlers published: onto the controller's bus and into its log."""
        try:
            event = decode_event(bytes(message.event))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("controller: an event from worker %d's handlers did not decode: %s", message.worker, exc)
            return
        await self._c.bus.publish(msgspec.structs.replace(event, source=f"{SOURCE_PREFIX}{message.worker}"))
