"""The runtime: owns the task group and starts each component in it (bus, executor, watchers).

Typical use (through :class:`elastic_runtime.ElasticRuntime`, this class with the built-in handlers wired in)::

    rt = ElasticRuntime(job, mesh_policy=MeshPolicy({"data": 8}))

    @rt.on(SliceLost)
    async def tell_someone(event, ctx): ...

    result = rt.run(steps=1000)          # or: await rt.run_async(steps=1000)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import anyio
import jax
from jax.sharding import Mesh

from elastic_runtime.core.bus import EventBus, Handler, Subscription
from elastic_runtime.core.compile_cache import persistent_cache
from elastic_runtime.core.config import RuntimeConfig
from elastic_runtime.core.context import RuntimeContext
from elastic_runtime.core.errors import BusClosed
from elastic_runtime.core.eventlog import EventLog
from elastic_runtime.core.events import (
    Event,
    LikelyMeshesReady,
    MeshReady,
    RunFinished,
    ScaleUpAvailable,
    never_published,
)
from elastic_runtime.core.executor import BoundaryHook, RunResult, StepExecutor
from elastic_runtime.core.health import DeviceHealth
from elastic_runtime.core.job import TrainJob
from elastic_runtime.core.mesh import MeshPolicy, device_ids, mesh_shape
from elastic_runtime.core.progress import ProgressLines

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)


class Component(Protocol):
    """A long-running part of the runtime (a checkpointer, a notice listener): started in the runtime's
    task group before the first step, cancelled after the last one. It talks to the rest only via ``ctx``
    (publish events) and its own subscriptions; it opens no task group of its own.

    A component may also define ``async def finish(self, ctx)``: awaited after the last step of a successful
    run, while the bus still delivers, so that it can complete its work (the checkpointer commits the final
    step there)."""

    async def run(self, ctx: RuntimeContext) -> None:
        """Do the component's work until cancelled; an exception it raises ends the run."""
        ...


class Runtime:
    """Runs one training job elastically, with exactly the handlers and components it is given. Single use.

    This is the core: it wires in no handler and no checkpoint tier of its own. :class:`elastic_runtime.ElasticRuntime`
    is this class with the built-in ones (re-mesh, restore, scale-up, the configured tiers and notice
    sources) subscribed through the same ``subscribe`` and ``add_component`` a user calls.

    Args:
        job: what to train.
        config: runtime settings (defaults work on a laptop).
        mesh_policy: mesh layout and shrink rules; default: every device on one ``data`` axis.
    """

    def __init__(
        self,
        job: TrainJob,
        *,
        config: RuntimeConfig | None = None,
        mesh_policy: MeshPolicy | None = None,
    ) -> None:
        self.job = job
        self.config = config or RuntimeConfig()
        self.policy = mesh_policy or MeshPolicy({"data": len(jax.devices())})
        self.policy_given = mesh_policy is not None
        self.health = DeviceHealth()
        self.event_log = EventLog(Path(self.config.run_dir) / "events.jsonl") if self.config.run_dir else None
        self.context = RuntimeContext(self)
        self.bus = EventBus(
            self.context,
            max_pending=self.config.max_pending_events,
            handler_timeout=self.config.handler_timeout_s,
            log=self.event_log,
        )
        self.executor = StepExecutor(job, bus=self.bus, config=self.config, policy=self.policy, health=self.health)
        self.components: list[Component] = []
        if self.config.progress:
            self.add_component(ProgressLines(self.executor.core, every_s=self.config.progress_every_s))
        self._used = False

    # --- the user's hooks ------------------------------------------------------------------------------

    def on(
        self, event_type: type[E], *, priority: int = 0, timeout: float | str | None = "default", once: bool = False
    ) -> Callable[[Handler[E]], Handler[E]]:
        """Decorator: call the handler for every event of ``event_type`` (and its subclasses); see
        :meth:`subscribe`."""
        return self.bus.on(event_type, priority=priority, timeout=timeout, once=once)

    def subscribe(
        self,
        event_type: type[E],
        handler: Handler[E],
        *,
        priority: int = 0,
        timeout: float | str | None = "default",
        once: bool = False,
    ) -> Subscription[E]:
        """Call ``handler`` for every event of ``event_type`` (and its subclasses); returns the subscription,
        which :meth:`RuntimeContext.unsubscribe` ends. ``priority``: higher runs first; ``timeout``: seconds a
        call may take before it counts as failed (``"default"``: the config's handler timeout).

        ``once``: under ``elastic-runtime launch`` a handler runs in every worker process by default, at the
        same step boundary, because a request that changes the state (``ctx.transform_state``) must be made in
        every process; ``once=True`` runs it in the lead process only, for side effects wanted once per event (a
        message, a page, a file). In one process both mean the same."""
        return self.bus.subscribe(event_type, handler, priority=priority, timeout=timeout, once=once)

    def add_component(self, component: Component) -> Component:
        """Start ``component.run(ctx)`` with the run and cancel it when the run ends."""
        self.components.append(component)
        return component

    def at_step_boundary(self, hook: BoundaryHook) -> BoundaryHook:
        """Call ``hook(next_step)`` (sync or async) before every step."""
        self.executor.hooks.append(hook)
        return hook

    # --- running ---------------------------------------------------------------------------------------

    def run(self, steps: int, *, resume: bool = False) -> RunResult:
        """Run to ``steps`` committed steps in a new event loop (for ordinary scripts); see :meth:`run_async`."""
        return anyio.run(functools.partial(self.run_async, steps, resume=resume))

    async def run_async(self, steps: int, *, resume: bool = False) -> RunResult:
        """Run to ``steps`` committed steps (in all: a resumed run counts the steps it restored) inside the
        caller's event loop.

        Args:
            steps: the step to reach.
            resume: first restore the newest verified step any durable tier holds (``/dev/shm``, disk, GCS,
                from the fastest holding it), as an earlier process of the same job left it. Without it, tiers
                that already hold checkpoints are an error: a new run would mix its checkpoints with theirs.

        Raises:
            StepError: the user's step raised; the last committed state is intact.
            RecoveryError: a failure could not be recovered from.
            MeshUnavailable: the mesh policy does not fit the devices at start.
            ConfigError: the tiers hold checkpoints and ``resume`` is off, or the newest is beyond ``steps``.
        """
        if self._used:
            raise RuntimeError("an ElasticRuntime runs once; build a new one for another run")
        self._used = True
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        never = never_published("embedded", [sub.event_type for sub in self.bus.subscriptions])
        if never:
            log.warning("handlers subscribed to events one process never publishes: %s", "; ".join(never))
        with persistent_cache(self.config.compile_cache, self.config.run_dir):
            return await self._run(steps, resume)

    async def _run(self, steps: int, resume: bool) -> RunResult:
        result: RunResult | None = None
        error: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.bus.run)
                helpers = anyio.CancelScope()
                tg.start_soon(self._helpers, helpers)
                finished = RunFinished(source="runtime", ok=False, reason="cancelled")
                try:
                    result = await self.executor.run(steps, resume=resume)
                    await self.bus.join()  # handlers of the last steps' events may still ask for a checkpoint
                    for component in self.components:
                        finish = getattr(component, "finish", None)
                        if finish is not None:
                            await finish(self.context)
                    finished = RunFinished(step=result.step, source="runtime", ok=True)
                except Exception as exc:
                    # Raised after the task group has closed, so the caller sees it unwrapped.
                    error = exc
                    finished = RunFinished(step=self.executor.step, source="runtime", ok=False, reason=f"{exc}")
                finally:
                    helpers.cancel()
                    with anyio.CancelScope(shield=True):
                        await self.bus.publish(finished)
                        await self.bus.close()
        finally:
            self.executor.close()
            if self.event_log is not None:
                self.event_log.close()
        if error is not None:
            raise error
        assert result is not None
        result.events_path = str(self.event_log.path) if self.event_log else None
        return result

    async def _helpers(self, scope: anyio.CancelScope) -> None:
        with scope:
            async with anyio.create_task_group() as tg:
                if self.config.precompile:
                    tg.start_soon(self._precompile)
                if self.config.scale_up_poll_s is not None:
                    tg.start_soon(self._watch_for_devices, self.config.scale_up_poll_s)
                for component in self.components:
                    tg.start_soon(component.run, self.context)

    async def _precompile(self) -> None:
        """After each mesh change, compile the step (and its snapshot copy) for the meshes a next failure would
        lead to: as many at once as the machine has cores but one (XLA compiles outside the GIL), most likely first.
        ``LikelyMeshesReady`` says when all are done. A failure whose mesh is not ready yet does not wait
        behind the others: the executor compiles that one itself, at once (``StepCompiler.get``).

        A compile that fails here stops nothing: for the current mesh the step meets the same error and ends
        the run with ``StepError``; a likely next mesh that cannot run the job is logged, and a failure that
        leads to it meets the error then.
        """
        async for mesh in self.executor.mesh_updates:
            compiler = self.executor.compiler
            if compiler is None:
                continue
            started = time.monotonic()
            if not compiler.is_ready(mesh) and not await self._prepare(mesh):  # the executor needs it first
                continue
            healthy = await anyio.to_thread.run_sync(self.health.healthy)
            candidates = self.policy.likely_meshes(mesh, healthy)
            # One core stays with the training, and with the compile of a mesh a failure needs at once: on 2
            # cores two compiles beside the training took 4x as long each (flax example), no mesh was ready
            # sooner, and a failure's own compile shared the cores with both (17-47 s for a 3 s compile).
            limiter = anyio.CapacityLimiter(max(1, min((os.cpu_count() or 1) - 1, len(candidates))))

            async with anyio.create_task_group() as tg:
                for candidate in candidates:  # the limiter lets them in in this order: most likely first
                    tg.start_soon(self._prepare_ahead, candidate, limiter)
            if candidates and all(compiler.is_ready(c) for c in candidates):
                ready = LikelyMeshesReady(
                    step=self.executor.step,
                    source="compiler",
                    mesh_shape=mesh_shape(mesh),
                    meshes=len(candidates),
                    seconds=time.monotonic() - started,
                )
                with contextlib.suppress(BusClosed):
                    await self.bus.publish(ready)

    async def _prepare_ahead(self, mesh: Mesh, limiter: anyio.CapacityLimiter) -> None:
        async with limiter:
            # Not while a failure is recovered: the executor compiles the mesh it needs itself, at once, and a
            # compile of another mesh started now would only take cores from it. Nor once the mesh changed:
            # the new mesh's likely meshes are planned next.
            if self.executor.recovering or self.executor.mesh_updates.statistics().current_buffer_used:
                return
            await self._prepare(mesh)

    async def _prepare(self, mesh: Mesh) -> bool:
        try:
            seconds = await anyio.to_thread.run_sync(self.executor.prepare, mesh)
        except Exception as exc:
            log.warning("compiling ahead for mesh %s failed: %s: %s", mesh_shape(mesh), type(exc).__name__, exc)
            return False
        if seconds > 0:
            ready = MeshReady(
                step=self.executor.step,
                source="compiler",
                mesh_shape=mesh_shape(mesh),
                devices=device_ids(mesh),
                seconds=seconds,
                loaded=self.executor.compiler.loaded(mesh) if self.executor.compiler else 0,
            )
            with contextlib.suppress(BusClosed):  # the run ended while this compile ran: nobody to tell
                await self.bus.publish(ready)
        return True

    async def _watch_for_devices(self, interval: float) -> None:
        """Publish ScaleUpAvailable when healthy devices would allow a larger mesh than the current one."""
        announced: tuple[int, ...] = ()
        while True:
            await anyio.sleep(interval)
            mesh = self.executor.mesh
            if mesh is None or self.executor.recovering:
                continue
            healthy = await anyio.to_thread.run_sync(self.health.healthy)
            shape = self.policy.shape_for(len(healthy))
            ids = tuple(sorted(d.id for d in healthy))
            if shape and math.prod(shape.values()) > mesh.devices.size and ids != announced:
                announced = ids
                await self.bus.publish(
                    ScaleUpAvailable(step=self.executor.step, source="health", devices=ids, shape=shape)
                )
            elif ids == device_ids(mesh):
                announced = ()
