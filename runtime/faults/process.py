"""Process and worker faults of the grammar (``elastic_runtime.faults.grammar``) for multi-process runs.

The controller-side faults signal a member once the group commits a step, or while the next group forms
after a failure; the worker-side ones make a worker die mid-step, die while writing its replica file, hang in a
step, slow down, or corrupt its copy of the state. Both plug into hooks the multi-process mode has for everyone:
the controller's bus (``StepCompleted``, ``GroupForming``) and a worker's step checks and input faults (its
``core``: elastic_runtime.core.step_core) and replica-write listeners.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.events import GroupFormed, GroupForming, StepCompleted
from elastic_runtime.faults.corruption import flip_a_bit
from elastic_runtime.faults.grammar import PROCESS_SIGNALS, Fault, format_faults, parse_faults

__all__ = ["FAULT_INJECTION", "ProcessFaults", "attach_worker_faults", "worker_faults_text"]

FAULT_INJECTION = "fault injection: "  # how the reason of a kill the faults made starts (the console shows those)


class _Context(Protocol):
    @property
    def members(self) -> tuple[int, ...]: ...

    def signal(self, worker: int, signal: str, reason: str) -> None: ...


class ProcessFaults:
    """The controller-side faults of a run: ``kill``, ``stop`` and ``term`` of a member by process id.

    ``kill:P@S`` names a position in the group (process ``P``, as ``jax.process_index()`` counts), not a worker
    id: after a re-forming another worker holds it. The ``WorkerKilled`` event names both, as does its reason.
    """

    def __init__(self, faults: Iterable[Fault]) -> None:
        self.pending = [fault for fault in faults if fault.kind == "process"]

    def attach(self, bus: EventBus) -> ProcessFaults:
        """Subscribe to the controller's bus."""
        bus.subscribe(StepCompleted, self.on_step)
        bus.subscribe(GroupForming, self.on_forming)
        bus.subscribe(GroupFormed, self.on_restoring)
        return self

    async def on_step(self, event: StepCompleted, ctx: _Context) -> None:
        step = event.step or 0
        for fault in [f for f in self.pending if not (f.forming or f.restoring) and f.due(step)]:
            self.pending.remove(fault)
            if fault.target < len(ctx.members):
                worker = ctx.members[fault.target]
                why = f"{FAULT_INJECTION}{fault} (process {fault.target} of the group: worker {worker})"
                ctx.signal(worker, PROCESS_SIGNALS[fault.action], why)

    async def on_forming(self, event: GroupForming, ctx: _Context) -> None:
        if event.strategy != "start":  # "forming" means a re-forming after a failure
            self._signal([f for f in self.pending if f.forming], event.members, "forming", ctx)

    async def on_restoring(self, event: GroupFormed, ctx: _Context) -> None:
        # Published once every member was sent the step to restore: they are restoring it now.
        if event.strategy != "start":
            self._signal([f for f in self.pending if f.restoring], event.members, "restoring", ctx)

    def _signal(self, faults: list[Fault], members: tuple[int, ...], group: str, ctx: _Context) -> None:
        for fault in faults:
            self.pending.remove(fault)
            position = min(fault.target, len(members) - 1)
            worker = members[position]
            why = f"{FAULT_INJECTION}{fault} (process {position} of the {group} group: worker {worker})"
            ctx.signal(worker, PROCESS_SIGNALS[fault.action], why)


def worker_faults_text(faults: Iterable[Fault], process_id: int) -> str:
    """The worker-side faults of ``process_id``, as the text a worker's ``Form`` carries."""
    return format_faults(f for f in faults if f.kind == "worker" and f.target == process_id)


class _Replicas(Protocol):
    @property
    def on_write(self) -> list[Callable[[int], None]]: ...


class _Core(Protocol):
    @property
    def step_checks(self) -> list[Callable[[int, tuple[int, ...]], None]]: ...

    @property
    def input_faults(self) -> list[Callable[[int, Any], Any]]: ...


class _Worker(Protocol):
    @property
    def core(self) -> _Core: ...

    @property
    def replicas(self) -> _Replicas: ...


def attach_worker_faults(worker: _Worker, text: str) -> None:
    """Make ``worker`` die or hang at the points ``text`` names (its own faults, from its ``Form``)."""
    for fault in parse_faults(text, kinds=("worker",)):
        if fault.action == "die-writing-replica":  # the first file at or after its step (files may skip steps)
            worker.replicas.on_write.append(_at(fault.step, _die, or_later=True))
        elif fault.action == "die-midstep":  # computed but not committed: the new state must not count
            worker.core.step_checks.append(_at(fault.step, _die))
        elif fault.action == "slow":
            assert fault.step is not None and fault.factor is not None
            worker.core.step_checks.append(_slow(fault.step, fault.factor))
        elif fault.action in ("corrupt", "corrupt-persistent"):
            assert fault.step is not None
            worker.core.input_faults.append(_corrupt(fault.step, persistent=fault.action == "corrupt-persistent"))
        else:  # hang: a deadlock in the step; heartbeats go on, progress stops
            worker.core.step_checks.append(_at(fault.step, lambda: threading.Event().wait()))


def _at(step: int | None, act: Callable[[], object], *, or_later: bool = False) -> Callable[..., None]:
    """A check of the step (or of the replica file's step) that acts at ``step``; the step's devices are ignored."""

    def check(current: int, *_devices: object) -> None:
        if current == step or (or_later and step is not None and current > step):
            act()

    return check


def _slow(step: int, factor: float) -> Callable[..., None]:
    """From ``step`` on, sleep ``factor - 1`` times the work done since the last sleep: a straggler's iteration
    takes ``factor`` times its own work (it arrives last at the collectives, so that work includes no wait)."""
    ended: list[float] = []

    def check(current: int, *_devices: object) -> None:
        if current < step:
            return
        if ended:
            time.sleep((factor - 1) * (time.perf_counter() - ended[0]))
        ended[:] = [time.perf_counter()]

    return check


def _corrupt(after: int, *, persistent: bool) -> Callable[[int, Any], Any]:
    """A bit of this process's first device's copy of the state flipped in what step ``after + 1`` reads (once:
    a replay of that step reads it whole), or, ``persistent``, in what every step from then on reads."""

    done: list[int] = []

    def corrupt(step: int, state: Any) -> Any:
        if (step == after + 1 and not done) or (persistent and step > after):
            import jax  # here: the controller imports this module and never JAX

            done.append(step)
            return flip_a_bit(state, jax.local_devices()[0].id)[0]
        return state

    return corrupt


def _die() -> None:
    """A real kill -9 of this process, at an exact point."""
    os.kill(os.getpid(), signal.SIGKILL)
