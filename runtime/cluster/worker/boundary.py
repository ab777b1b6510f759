"""The worker's half of the script's own handlers under ``launch``: the group's events, run at a step boundary.

A training script's handlers (``runtime.on(...)``, ``runtime.subscribe``) run in every worker process. The
controller forwards the group's events to the members (``runtime/cluster/controller/relay.py``); each arrives here
(``received``, in the link's reader thread) and waits for a step boundary. In multi-controller JAX a request
that changes the state (``ctx.transform_state``) must be applied by every process at the same step: so
before each step the members agree, with one small collective, on the newest notification every one of
them holds, and each runs the same notifications' handlers there, in order, then applies their requests.
Handlers therefore run once in every process for each of the group's events; ``ctx.lead`` is true in
process 0 only, for side effects wanted once. The collective runs only when the script subscribed to
something (the smallest of one number per process, a step: ``collectives.GroupMinimum``).

Requests: ``transform_state`` (applied in every process at that boundary), ``request_checkpoint`` (a durable
checkpoint of the step, with ``launch --durable``), ``abort`` (the controller ends the run, once),
``publish`` (the lead's events go to the controller's bus and log). What this mode cannot do (``remesh``,
``cordon``, ...: the controller owns the group) raises :class:`~elastic_runtime.core.errors.UnsupportedInMode`.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import msgspec

from elastic_runtime.cluster.protocol import Notify, Published, Requested
from elastic_runtime.cluster.worker.state import WorkerState
from elastic_runtime.core.bus import EventBus, Subscription
from elastic_runtime.core.errors import UnsupportedInMode
from elastic_runtime.core.eventlog import decode_event, encode_event
from elastic_runtime.core.events import Event, HandlerFailed, RunFinished, StateTransformed, StepFailed
from elastic_runtime.core.handler_context import Mode

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from elastic_runtime.core.job import PyTree

__all__ = ["Boundary", "ScriptHandlers", "WorkerContext"]

log = logging.getLogger(__name__)

MODE = "`elastic-runtime launch` (a worker of a multi-process group)"


@dataclass
class Boundary:
    """What the handlers run at one step boundary asked for."""

    state: PyTree | None = None  # the transformed state, placed like the old one; None: unchanged
    checkpoint: bool = False  # write a durable checkpoint of the step
    stop: bool = False  # the run ends (an abort, a failed transform): step no more, wait for the controller


@dataclass
class _Requests:
    transforms: list[tuple[Callable[[Any], Any], str]] = field(default_factory=list)
    checkpoint: bool = False
    aborts: list[str] = field(default_factory=list)


class WorkerContext:
    """The ``ctx`` the script's handlers get in a worker: a :class:`~elastic_runtime.core.context.HandlerContext`.
    Requests mean what they mean in one process; those this mode cannot carry out raise
    :class:`UnsupportedInMode` naming it."""

    def __init__(self, worker: WorkerState, requests: _Requests) -> None:
        self._w = worker
        self._requests = requests

    @property
    def mode(self) -> Mode:
        """``worker``: one process of a ``launch`` group."""
        return "worker"

    @property
    def step(self) -> int:
        """The newest step the group committed (the boundary the handlers run at)."""
        return self._w.step

    @property
    def lead(self) -> bool:
        """True in process 0 only: for side effects wanted once per event (a message, a file)."""
        return self._w.process_id == 0

    @property
    def process_id(self) -> int:
        """This process's index in the group."""
        return self._w.process_id

    @property
    def num_processes(self) -> int:
        """The group's processes."""
        return self._w.num_processes

    @property
    def generation(self) -> int:
        """The group's generation: one more at every re-forming."""
        return self._w.generation

    @property
    def mesh(self) -> Mesh | None:
        """The group's mesh (across every process's devices)."""
        mesh: Mesh | None = self._w.mesh
        return mesh

    @property
    def recovering(self) -> bool:
        """Always False: handlers run at a boundary of a formed, restored group."""
        return False

    def transform_state(self, fn: Callable[[Any], Any], reason: str = "") -> None:
        """Replace the state at this boundary with ``fn(state)``, in every process (``fn`` is traced with
        ``jax.jit``, as the step is, and must keep the state's structure, shapes and dtypes; an error ends the
        run with ``StepError``). The replicas hold the transformed state from the next committed step on."""
        self._requests.transforms.append((fn, reason))

    def abort(self, reason: str) -> None:
        """Give up: the controller stops every worker and the run ends with RecoveryError(reason)."""
        self._requests.aborts.append(reason)

    async def request_checkpoint(self, tiers: tuple[str, ...] = (), reason: str = "") -> None:
        """A durable checkpoint of this step (``launch --durable``: the only durable tier in this mode)."""
        if self._w.durable is None:
            raise UnsupportedInMode(
                f"ctx.request_checkpoint under {MODE} needs a durable tier: start the run with `launch --durable DIR`"
            )
        if tiers and set(tiers) != {"durable"}:
            raise UnsupportedInMode(f"ctx.request_checkpoint under {MODE}: the only tier is 'durable', not {tiers}")
        self._requests.checkpoint = True

    async def publish(self, event: Event) -> None:
        """Onto the controller's bus and into the run's event log (sent by the lead process only: once)."""
        if self.lead:
            self._w.link.send(Published(worker=self._w.worker, event=msgspec.Raw(encode_event(event))))

    def _unsupported(self, what: str, why: str) -> NoReturn:
        raise UnsupportedInMode(f"ctx.{what} is not available under {MODE}: {why}")

    def remesh(self, mesh: Any, reason: str = "") -> None:
        """Not in a worker: raises ``UnsupportedInMode`` (the controller forms the group's mesh)."""
        self._unsupported("remesh", "the controller forms the group's mesh (from --nprocs, --slices)")

    def restore(self, source: str = "latest") -> None:
        """Not in a worker: raises ``UnsupportedInMode`` (the controller picks every restore)."""
        self._unsupported("restore", "the controller picks the step every re-formed group restores")

    def pause(self, reason: str = "") -> None:
        """Not in a worker: raises ``UnsupportedInMode`` (a member that stops stepping stalls its peers)."""
        self._unsupported("pause", "a member that stops stepping stalls its peers' collectives")

    def resume(self, reason: str = "") -> None:
        """Not in a worker: raises ``UnsupportedInMode`` (a member that stops stepping stalls its peers)."""
        self._unsupported("resume", "a member that stops stepping stalls its peers' collectives")

    def cordon(self, devices: tuple[int, ...]) -> None:
        """Not in a worker: raises ``UnsupportedInMode`` (the controller replaces processes, not devices)."""
        self._unsupported("cordon", "the controller replaces whole processes, not devices")

    def uncordon(self, devices: tuple[int, ...]) -> None:
        """Not in a worker: raises ``UnsupportedInMode`` (the controller replaces processes, not devices)."""
        self._unsupported("uncordon", "the controller replaces whole processes, not devices")

    async def healthy_devices(self) -> list[Any]:
        """Not in a worker: raises ``UnsupportedInMode`` (the controller judges processes)."""
        self._unsupported("healthy_devices", "a worker sees its own devices only; the controller judges processes")

    def subscribe(self, *args: Any, **kwargs: Any) -> Any:
        """Not in a worker: raises ``UnsupportedInMode`` (subscribe on the script's runtime before run())."""
        self._unsupported("subscribe", "subscribe on the script's runtime before run()")


class ScriptHandlers:
    """The script's subscriptions and the notifications waiting for a step boundary, in one worker."""

    def __init__(self, subscriptions: Sequence[Subscription[Any]], *, handler_timeout: float | None = 30.0) -> None:
        self.subscriptions = list(subscriptions)
        self.handler_timeout = handler_timeout
        self.events = tuple(sorted({s.event_type.__name__ for s in self.subscriptions}))
        self._lock = threading.Lock()
        self._waiting: dict[int, Notify] = {}  # seq -> notification, of any generation

    def received(self, notify: Notify) -> None:
        """A notification from the controller (called in the link's reader thread)."""
        with self._lock:
            self._waiting[notify.seq] = notify

    def _newest(self, generation: int) -> int:
        with self._lock:
            for seq in [s for s, n in self._waiting.items() if n.generation < generation]:
                log.warning("the group re-formed before its handlers ran for notification %d; dropped", seq)
                del self._waiting[seq]
            return max((s for s, n in self._waiting.items() if n.generation == generation), default=0)

    def boundary(self, worker: WorkerState) -> tuple[Boundary, float]:
        """At a step boundary, in the step thread (the all-gather is a collective, abandoned like a step): run
        the handlers of the notifications every member holds, then carry out what they asked."""
        agreed = worker.group_minimum(self._newest(worker.generation))
        with self._lock:
            mine = [
                s for s in sorted(self._waiting) if s <= agreed and self._waiting[s].generation == worker.generation
            ]
            due = [self._waiting.pop(s) for s in mine]
        if not due:
            return Boundary(), 0.0
        requests = _Requests()
        failures = self._run(due, WorkerContext(worker, requests))
        done = Boundary(checkpoint=requests.checkpoint)
        for failure in failures:  # the lead's go to the controller's log, once
            if worker.process_id == 0:
                worker.link.send(Published(worker=worker.worker, event=msgspec.Raw(encode_event(failure))))
        for reason in requests.aborts:
            worker.link.send(Requested(worker=worker.worker, seq=due[-1].seq, kind="abort", reason=reason))
            done.stop = True
        if requests.transforms and not done.stop:
            done.state, done.stop = self._transform(worker, requests.transforms)
        return done, 0.0

    def finished(self, worker: WorkerState) -> None:
        """The group finished: the script's ``RunFinished`` handlers, in every worker, as the run's last event (the
        controller publishes its own after the workers have gone; in one process it is the last one too)."""
        result = worker.result
        step = result.step if result is not None else worker.step
        event = RunFinished(step=step, source=f"worker-{worker.worker}", ok=True)
        notify = Notify(seq=0, generation=worker.generation, event=msgspec.Raw(encode_event(event)))
        if any(issubclass(RunFinished, sub.event_type) for sub in self.subscriptions):
            self._run([notify], WorkerContext(worker, _Requests()))

    def _run(self, due: list[Notify], ctx: WorkerContext) -> list[HandlerFailed]:
        """Dispatch ``due``'s events to the script's handlers on a local bus (priorities, timeouts and
        ``HandlerFailed`` as on the script's own); returns the failures."""
        failures: list[HandlerFailed] = []

        async def failed(event: HandlerFailed, _ctx: Any) -> None:
            failures.append(event)

        async def dispatch() -> None:
            bus = EventBus(ctx, handler_timeout=self.handler_timeout)
            for sub in self.subscriptions:
                if sub.once and not ctx.lead:
                    continue  # run once per event: in the lead process
                bus.subscribe(sub.event_type, sub.handler, priority=sub.priority, timeout=sub.timeout)
            bus.subscribe(HandlerFailed, failed, priority=10**9)
            async with anyio.create_task_group() as tg:
                tg.start_soon(bus.run)
                for notify in due:
                    try:
                        await bus.publish(decode_event(bytes(notify.event)))
                    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                        log.error("notification %d did not decode as an event: %s", notify.seq, exc)
                await bus.close()

        anyio.run(dispatch)
        return failures

    def _transform(self, worker: WorkerState, transforms: list[tuple[Callable[[Any], Any], str]]) -> tuple[Any, bool]:
        """Every requested transform, in order, on the committed state; (new state, False), or (None, True)
        once a failure was reported (the run ends with StepError)."""
        import time

        state = worker.core.state
        for fn, reason in transforms:
            started = time.monotonic()
            try:
                state = worker.core.transform(fn, state, worker.state_shardings)
            except Exception as exc:
                message = f"ctx.transform_state ({reason}) at step {worker.step}: {type(exc).__name__}: {exc}"
                log.error("%s", message)
                failed = StepFailed(step=worker.step, source="worker", error_type=type(exc).__name__, message=message)
                worker.report_failure(failed, traceback.format_exc())
                return None, True
            if worker.process_id == 0:
                transformed = StateTransformed(
                    step=worker.step, source="worker", reason=reason, seconds=time.monotonic() - started
                )
                worker.link.send(Published(worker=worker.worker, event=msgspec.Raw(encode_event(transformed))))
        return state, False
