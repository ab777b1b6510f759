"""The context a handler receives in one process: what it may look at and the requests it may make.

:class:`RuntimeContext` is the embedded mode's :class:`~elastic_runtime.core.handler_context.HandlerContext`, the
members every ``ctx`` has in every mode.

Requests to the executor (pause, resume, re-mesh, restore, abort) never block: they are queued and carried
out at the next step boundary, in order, and each is announced by an event (``MeshChanged``,
``StateRestored`` ...). Recovery is therefore a visible chain of events that a user can extend or replace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
from jax.sharding import Mesh

from elastic_runtime.core.bus import EventBus, Handler, Subscription
from elastic_runtime.core.commands import Abort, Pause, Remesh, Restore, Resume, TransformState
from elastic_runtime.core.config import RuntimeConfig
from elastic_runtime.core.events import Event, SaveCheckpoint
from elastic_runtime.core.handler_context import Mode
from elastic_runtime.core.mesh import MeshPolicy, device_ids

if TYPE_CHECKING:
    from elastic_runtime.core.executor import StepExecutor
    from elastic_runtime.core.health import DeviceHealth

E = TypeVar("E", bound=Event)


class _Runtime(Protocol):
    """What the context reads of its runtime (``Runtime``, which makes it: no import back to it)."""

    config: RuntimeConfig
    policy: MeshPolicy
    bus: EventBus
    health: DeviceHealth
    executor: StepExecutor


class RuntimeContext:
    """Handed to every handler as ``ctx`` in one process (embedded): a :class:`HandlerContext`."""

    def __init__(self, runtime: _Runtime) -> None:
        self._runtime = runtime

    @property
    def mode(self) -> Mode:
        """``embedded``: this process drives every device of the run."""
        return "embedded"

    @property
    def lead(self) -> bool:
        """Always True: one process, so every handler runs once per event."""
        return True

    @property
    def process_id(self) -> int:
        """0: the one process."""
        return 0

    @property
    def num_processes(self) -> int:
        """1: the one process."""
        return 1

    @property
    def config(self) -> RuntimeConfig:
        """The run's configuration."""
        return self._runtime.config

    @property
    def policy(self) -> MeshPolicy:
        """The mesh policy: the target shape and how it shrinks onto fewer devices."""
        return self._runtime.policy

    @property
    def mesh(self) -> Mesh | None:
        """The mesh the steps run on now (``None`` before the first one is built)."""
        return self._runtime.executor.mesh

    @property
    def mesh_devices(self) -> tuple[int, ...]:
        """The ids of the devices in the current mesh (empty before the first mesh)."""
        mesh = self.mesh
        return () if mesh is None else device_ids(mesh)

    @property
    def step(self) -> int:
        """The newest committed step."""
        return self._runtime.executor.step

    @property
    def recovering(self) -> bool:
        """True from a failure's ``RecoveryStarted`` until the next committed step (``RecoveryCompleted``)."""
        return self._runtime.executor.recovering

    async def publish(self, event: Event) -> None:
        """Put ``event`` on the bus: it is logged and delivered to its subscribers, after this handler returns."""
        await self._runtime.bus.publish(event)

    def subscribe(
        self, event_type: type[E], handler: Handler[E], *, priority: int = 0, timeout: float | str | None = "default"
    ) -> Subscription[E]:
        """Subscribe ``handler`` to ``event_type`` (for components, which subscribe once they run)."""
        return self._runtime.bus.subscribe(event_type, handler, priority=priority, timeout=timeout)

    def unsubscribe(self, subscription: Subscription[Any]) -> None:
        """End a subscription that :meth:`subscribe` returned."""
        self._runtime.bus.unsubscribe(subscription)

    async def healthy_devices(self) -> list[Any]:
        """Probe every device and return the healthy ones (runs in a worker thread)."""
        return await anyio.to_thread.run_sync(self._runtime.health.healthy)

    def cordon(self, devices: tuple[int, ...]) -> None:
        """Treat ``devices`` as unhealthy (e.g. before their host's maintenance) until :meth:`uncordon`."""
        self._runtime.health.cordon(devices)

    def uncordon(self, devices: tuple[int, ...]) -> None:
        """Let ``devices`` count as healthy again; the scale-up watcher then offers them back."""
        self._runtime.health.uncordon(devices)

    def pause(self, reason: str = "") -> None:
        """Stop running steps at the next boundary until :meth:`resume` (e.g. while a drain moves devices)."""
        self._runtime.executor.send(Pause(reason))

    def resume(self, reason: str = "") -> None:
        """Run steps again after :meth:`pause` or a recovery; the run fails with ``RecoveryError`` if no state
        is held to resume from."""
        self._runtime.executor.send(Resume(reason))

    def remesh(self, mesh: Mesh, reason: str = "") -> None:
        """Move to ``mesh`` at the next boundary: live state is resharded; lost state must be restored."""
        self._runtime.executor.send(Remesh(mesh, reason))

    def restore(self, source: str = "latest") -> None:
        """Restore onto the current mesh from ``source``: a tier name, or "latest" (fastest tier first)."""
        self._runtime.executor.send(Restore(source))

    def transform_state(self, fn: Callable[[Any], Any], reason: str = "") -> None:
        """Replace the state at the next boundary with ``fn(state)`` (a pytree of the same structure, shapes
        and dtypes), e.g. to lower a learning rate kept in the state after a failure. ``fn`` gets the
        committed state as placed on the current mesh; its result is placed the same way. Announced by
        ``StateTransformed``; an error in ``fn`` or a changed structure ends the run with ``StepError``.
        The RAM snapshot holds the transformed state from the next committed step on."""
        self._runtime.executor.send(TransformState(fn, reason))

    def abort(self, reason: str) -> None:
        """Give up: the run stops with RecoveryError(reason)."""
        self._runtime.executor.send(Abort(reason))

    async def request_checkpoint(self, tiers: tuple[str, ...] = (), reason: str = "") -> None:
        """Ask the checkpointer to save the newest snapshot to ``tiers`` (default: all durable tiers)."""
        await self.publish(SaveCheckpoint(step=self.step, source="context", tiers=tiers, reason=reason))
