"""The step executor: runs the user's step off the event loop and turns failures into events.

Each step runs in a worker thread, so the bus, heartbeats and listeners stay live while XLA computes.
Between steps the executor applies the commands handlers sent through the context (pause, resume,
re-mesh, restore, abort). A step that raises is not committed: an infrastructure failure pauses the
executor until handlers have re-meshed, restored and resumed it; an error in the user's code stops the run
with :class:`StepError`. Nothing is retried behind the user's back.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

import anyio
import jax
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from jax.sharding import Mesh

from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.cadence import SnapshotCadence
from elastic_runtime.core.commands import Abort, Command, Pause, Remesh, Restore, Resume, TransformState
from elastic_runtime.core.compiler import StepCompiler
from elastic_runtime.core.config import RuntimeConfig
from elastic_runtime.core.datacheck import DataCheck
from elastic_runtime.core.errors import ConfigError, RecoveryError, SnapshotUnavailable, StepError
from elastic_runtime.core.events import (
    CheckpointFailed,
    CorruptionHealed,
    Event,
    MeshChanged,
    MeshReduced,
    RunStarted,
    StateRestored,
    StateTransformed,
    StepCompleted,
    StepFailed,
)
from elastic_runtime.core.fingerprint import STATE_DIGEST, Healed, Integrity, StateDiverged, state_digest
from elastic_runtime.core.health import DeviceHealth
from elastic_runtime.core.initial import abstract_state, initial_program
from elastic_runtime.core.job import PyTree, TrainJob
from elastic_runtime.core.keys import with_key_data
from elastic_runtime.core.ledger import StepLedger
from elastic_runtime.core.mesh import MeshPolicy, device_ids, mesh_shape
from elastic_runtime.core.prefetch import BatchPrefetcher
from elastic_runtime.core.restore import RestoreSource, refuse_earlier_checkpoints, restore_newest
from elastic_runtime.core.snapshot import RamTier, in_host_memory
from elastic_runtime.core.step_core import StepCore

log = logging.getLogger(__name__)

BoundaryHook = Callable[[int], Awaitable[None] | None]


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class _StepDone(NamedTuple):
    state: PyTree
    loss: float | None
    metrics: dict[str, float]  # every scalar the step returned (elastic_runtime.core.metrics)
    seconds: float  # the step's computation
    data_s: float  # loading its batch
    snapshot_wait_s: float  # what its snapshot's copy added to the step (0 when compiled into the step)
    host: PyTree | None  # the state in host memory, when this step is snapshotted
    verified: bool  # its replicas were compared and agree, or are never compared (no fingerprints)
    digest: int | None  # the whole state's digest, at a step the durable tiers save (core/fingerprint.py)


class _InFlight(NamedTuple):
    """A step dispatched to the devices and not yet committed."""

    step: int
    position: int  # the data position its batch came from
    new_state: PyTree
    metrics: Any
    host: PyTree | None  # the host copy, compiled into the step or queued right behind it (on CPU devices the new
    # state itself); None: no snapshot
    dispatched: float  # perf_counter when its program was queued
    data_s: float
    measured: bool  # its time says what a step on this mesh costs (not the first run of the executable)


def _drain(flight: _InFlight | None) -> None:
    """Wait for a step dispatched on top of one that failed, so that nothing runs on the devices during
    recovery. Its own result, and its error if any, are dropped: it was computed from a failed step."""
    if flight is not None:
        try:
            jax.block_until_ready(flight.new_state)
        except Exception as exc:
            log.debug("dropped step %d, dispatched after a failed one: %s", flight.step, exc)


@dataclass
class RunResult:
    """What a finished run leaves: the final state on the host, and where its record is.

    Attributes:
        state: the final state, in host memory. Under ``elastic-runtime launch``: None, unless the script asked for
            it (``ElasticRuntime.run(..., gather=True)``, or the launch's ``--result``): then in the lead process
            (process 0) only, gathered from every process's shards.
        step: the last committed step.
        data_position: the data position after it.
        loss: its loss (the job's ``loss_key``), where the step reports one.
        mesh_history: every mesh the run trained on, in order.
        recoveries: the failures recovered from.
        events_path: the event log (``RuntimeConfig.run_dir``, or the launch's run folder); None without one.
        mode: ``embedded`` (one process), or ``worker`` (one process of an ``elastic-runtime launch`` group).
        lead: whether this process holds the run's result for everyone: always embedded; process 0 under launch.
        process_id: this process's index in the group (0 embedded).
        extra: more, for a caller's own use.
    """

    state: PyTree
    step: int
    data_position: int
    loss: float | None
    mesh_history: list[dict[str, int]]
    recoveries: int
    events_path: str | None = None
    mode: str = "embedded"
    lead: bool = True
    process_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class StepExecutor:
    """Runs steps on the current mesh and carries out the commands of recovery handlers."""

    def __init__(
        self,
        job: TrainJob,
        *,
        bus: EventBus,
        config: RuntimeConfig,
        policy: MeshPolicy,
        health: DeviceHealth,
    ) -> None:
        # The job as it runs: typed PRNG keys in its state held as key data (elastic_runtime.core.keys).
        self.job, self.keys = with_key_data(job)
        self.bus = bus
        self.config = config
        self.policy = policy
        self.health = health
        self.hooks: list[BoundaryHook] = []
        # The state's data-parallel replicas compared (silent data corruption): runtime/core/fingerprint.py.
        every = config.fingerprint_every
        self.integrity = Integrity(every, policy.batch_axis) if every != 0 else None
        self.ram = RamTier()
        self._by_reference = False  # a snapshot is the state itself (devices whose memory is the host's)
        # The RAM snapshot's cadence, and the measure of a step without a copy that Young-Daly plans by.
        self.cadence = SnapshotCadence(max(config.snapshot_every, 1), config.snapshot_mtbf_s)
        # The committed state and the step that moves it on, as a launch worker has them (core/step_core.py), and
        # its books: committed step, data position, when the RAM tier is due (decided as a step is dispatched: its
        # copy is queued right behind it), the recovery under way.
        ledger = StepLedger(
            "executor",
            max_failures=config.max_failures,
            policies={"ram": self.cadence} if config.snapshot_every > 0 else {},
            at_dispatch=("ram",),
        )
        self.core = StepCore(self.job, self.keys, ledger)
        self.ram.failure_listeners.append(self._snapshot_failed)
        # Where a restore looks, fastest first. The storage tiers append themselves after RAM.
        self.restore_sources: list[RestoreSource] = [self.ram]
        # Events raised in worker threads (steps, snapshot copies), published by the loop in order.
        self._from_threads: deque[Event] = deque()
        self._attention = threading.Event()  # set when a command waits: the step thread returns to the loop
        self._batches = BatchPrefetcher(job.data)
        self._data_check = DataCheck() if config.check_data else None
        # The step left computing while the loop publishes a batch of events, and when the step before it
        # was complete; it is committed when the thread comes back, or before any command applies.
        self._computing: tuple[_InFlight, float] | None = None
        self._warm_mesh: Mesh | None = None  # the mesh whose compiled step has run at least once
        self._hooked = 0  # the step whose boundary hooks have run
        self._inbox_send: MemoryObjectSendStream[Command]
        self._inbox: MemoryObjectReceiveStream[Command]
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[Command](math.inf)
        self.mesh_updates_send: MemoryObjectSendStream[Mesh]
        self.mesh_updates: MemoryObjectReceiveStream[Mesh]
        self.mesh_updates_send, self.mesh_updates = anyio.create_memory_object_stream[Mesh](math.inf)
        self.mesh: Mesh | None = None
        self.paused = False
        self.mesh_history: list[dict[str, int]] = []
        self._recovery_deadline = math.inf  # when the handlers must have resumed the current recovery
        self._resumed = False  # a handler resumed the current recovery
        self._initial: PyTree | None = None
        self.compiler: StepCompiler | None = None

    def close(self) -> None:
        """Release the executor's streams (after the run and every task reading them has ended)."""
        for stream in (self._inbox_send, self._inbox, self.mesh_updates_send, self.mesh_updates):
            stream.close()

    # --- commands (called by the context; never block) -------------------------------------------------

    def send(self, command: Command) -> None:
        self._inbox_send.send_nowait(command)
        self._attention.set()  # the worker thread stops after its current step

    @property
    def step(self) -> int:
        """The newest committed step."""
        return self.core.step

    @property
    def data_position(self) -> int:
        return self.core.data_position

    @property
    def recovering(self) -> bool:
        return self.core.ledger.recovering

    # --- the run ---------------------------------------------------------------------------------------

    async def run(self, steps: int, *, resume: bool = False) -> RunResult:
        """Run until ``steps`` steps are committed (``resume``: from the newest step the durable tiers hold).
        Raises StepError, RecoveryError or ConfigError when it cannot."""
        await self._start(steps, resume)
        if self.integrity is not None:
            self.integrity.durable_every = (self.config.disk_every, self.config.gcs_every)
            self.integrity.final = steps
        try:
            while self.step < steps:
                await self._boundary()
                if self.step < steps:
                    await self._run_steps(steps)
            await self._publish_from_threads()
        finally:
            if self._computing is not None:  # the run was cancelled or broke while a step computed
                _drain(self._computing[0])
            self.ram.close()
            self._batches.close()
        state = self.keys.to_keys(await anyio.to_thread.run_sync(jax.device_get, self.core.state))
        return RunResult(
            state=state,
            step=self.step,
            data_position=self.data_position,
            loss=self.core.loss,
            mesh_history=self.mesh_history,
            recoveries=self.core.ledger.recovery.failures,
        )

    async def _start(self, steps: int, resume: bool) -> None:
        healthy = await anyio.to_thread.run_sync(self.health.healthy)
        mesh = self.policy.fit(healthy)
        if mesh_shape(mesh) != self.policy.target_shape:
            log.warning("starting on mesh %s, smaller than the policy's %s", mesh_shape(mesh), self.policy.target_shape)
            await self.bus.publish(
                MeshReduced(
                    source="executor",
                    target_shape=self.policy.target_shape,
                    mesh_shape=mesh_shape(mesh),
                    devices=device_ids(mesh),
                )
            )
        try:
            # Shapes and dtypes only; the values are made on the mesh, each device's shards there (initial.py).
            self._initial = abstract_state(self.job)
            # On CPU devices a snapshot is the state itself, copied nowhere. Elsewhere, snapshotting every
            # step, the copy to host memory is compiled into the step itself.
            self._by_reference = in_host_memory(mesh)
            every_step = self.config.snapshot_every == 1 and self.config.snapshot_mtbf_s is None
            fused = every_step and not self._by_reference
            self.compiler = StepCompiler(self.job, self._initial, self.job.data.batch(0), host_copy=fused)
            self._set_mesh(mesh)
            self.core.state = await anyio.to_thread.run_sync(self._place_initial, mesh)
        except Exception as exc:  # the user's init, data or state specs: nothing ran, nothing to recover
            await self._stop_on_user_error(exc, 0, f"the job cannot start on mesh {mesh_shape(mesh)}")
        durable = [source for source in self.restore_sources if source is not self.ram]
        resumed = None
        if resume:
            resumed = await self._resume(durable, steps, mesh)
        else:
            await anyio.to_thread.run_sync(refuse_earlier_checkpoints, durable, self.config.checkpoint_timeout_s)
        if resumed is None and self.config.snapshot_every > 0:
            self._snapshot_initial(mesh)
        await self.bus.publish(
            RunStarted(
                step=self.step,
                source="executor",
                target_steps=steps,
                mesh_shape=mesh_shape(mesh),
                devices=device_ids(mesh),
            )
        )
        if resumed is not None:
            await self.bus.publish(resumed)

    async def _resume(self, durable: list[RestoreSource], steps: int, mesh: Mesh) -> StateRestored | None:
        """Restore the newest verified step any durable tier holds, before the first step; returns the event
        that says so (published after RunStarted), or None when there was nothing to resume from."""
        started = time.monotonic()
        timeout = self.config.checkpoint_timeout_s
        try:
            found, snapshot = await anyio.to_thread.run_sync(
                lambda: restore_newest(durable, self._initial, timeout=timeout)
            )
        except SnapshotUnavailable as exc:
            log.warning("resume: nothing to resume from, starting at step 0 (%s)", exc)
            return None
        if snapshot.step > steps:
            raise ConfigError(f"resume: the newest checkpoint is step {snapshot.step}, beyond the target {steps}")
        state = await anyio.to_thread.run_sync(self._place, snapshot.tree, mesh)
        seconds = time.monotonic() - started
        # What an earlier process committed counts as committed: the ledger's high water moves to it.
        return self.core.restored(
            state, snapshot.step, data_position=snapshot.data_position, restored_from=found.name, seconds=seconds
        )

    def _snapshot_initial(self, mesh: Mesh) -> None:
        """Step 0 is a step: the initial state is the RAM snapshot until the first step's, so a loss at step 1
        restores it rather than running ``init`` again (19.5 s of a 22.1 s recovery for MaxText's model). On CPU
        devices it is the state itself; elsewhere a copy in the background, beside the first step's compile."""
        metadata = {"mesh": mesh_shape(mesh)}
        if self._by_reference:
            self.ram.commit(self.core.state, step=0, data_position=0, metadata=metadata, notify=False)
        else:
            self.ram.capture(self.core.state, step=0, data_position=0, metadata=metadata, notify=False)

    def _set_mesh(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.mesh_history.append(mesh_shape(mesh))
        self.mesh_updates_send.send_nowait(mesh)

    def prepare(self, mesh: Mesh) -> float:
        """Compile what steps on ``mesh`` run (blocking): the step, and the snapshot copy queued behind it.
        Returns the seconds it took (waiting for a compile under way included; 0 when all was ready)."""
        assert self.compiler is not None
        started = time.perf_counter()
        compiled = not self.compiler.is_ready(mesh)
        self.compiler.get(mesh)
        if not (self.compiler.host_copy or self._by_reference) and self.config.snapshot_every > 0:
            compiled = self.ram.prepare(self.compiler.state_abstract(mesh)) or compiled
        if self.integrity is not None:
            self.integrity.fingerprinter.prepare(self.compiler.state_abstract(mesh))
        return time.perf_counter() - started if compiled else 0.0

    def _place_initial(self, mesh: Mesh) -> PyTree:
        assert self.compiler is not None
        return initial_program(self.job, self.compiler.state_shardings(mesh), mesh)()

    def _place(self, tree: PyTree, mesh: Mesh) -> PyTree:
        assert self.compiler is not None
        placed = jax.device_put(tree, self.compiler.state_shardings(mesh))
        return jax.block_until_ready(placed)

    async def _boundary(self) -> None:
        """Apply the commands handlers sent; wait for them while paused or recovering."""
        if self._computing is not None and self._attention.is_set():
            await self._run_steps(self._computing[0].step)  # a command applies to a committed step
        self._attention.clear()  # before draining: a command sent after this stops the next batch of steps
        while True:
            blocked = self.paused or (self.recovering and not self._resumed)
            if not blocked:
                try:
                    command = self._inbox.receive_nowait()
                except anyio.WouldBlock:
                    return
                await self._apply(command)
                continue
            wait = self._recovery_deadline - time.monotonic() if self.recovering else math.inf
            received: Command | None = None
            with anyio.move_on_after(max(wait, 0)):
                received = await self._inbox.receive()
            if received is None:
                await self._fail_recovery(
                    f"no handler completed the recovery within {self.config.recovery_timeout_s} s "
                    "(is a remesh/restore handler subscribed? HandlerFailed events in the log say which one broke)"
                )
            await self._apply(received)

    async def _apply(self, command: Command) -> None:
        match command:
            case Pause(reason):
                log.info("paused at step %d: %s", self.step, reason)
                self.paused = True
            case Resume(reason):
                if self.core.state is None:
                    await self._fail_recovery(f"resume ({reason}) requested but no state was restored")
                self.paused = False
                self._resumed = True
            case Remesh(mesh, reason):
                await self._remesh(mesh, reason)
            case Restore(source):
                await self._restore(source)
            case Abort(reason):
                await self._fail_recovery(reason)
            case TransformState(fn, reason):
                await self._transform(fn, reason)

    async def _transform(self, fn: Callable[[PyTree], PyTree], reason: str) -> None:
        """Replace the committed state with ``fn(state)``, placed like it. Raises StepError when ``fn``
        raises or changes the state's structure, shapes or dtypes (it is the user's code)."""
        assert self.mesh is not None
        if self.core.state is None:
            await self._fail_recovery(f"transform_state ({reason}) asked for before a state was restored")
        assert self.compiler is not None
        started, shardings = time.monotonic(), self.compiler.state_shardings(self.mesh)
        try:
            self.core.state = await anyio.to_thread.run_sync(self.core.transform, fn, self.core.state, shardings)
        except Exception as exc:
            await self._stop_on_user_error(exc, self.step, f"transform_state ({reason}) at step {self.step}")
        seconds = time.monotonic() - started
        await self.bus.publish(StateTransformed(step=self.step, source="executor", reason=reason, seconds=seconds))

    async def _remesh(self, mesh: Mesh, reason: str) -> None:
        old = self.mesh
        assert old is not None
        needs_restore = self.recovering or self.core.state is None
        started = time.monotonic()
        if needs_restore:
            self.core.state = None  # it lived on the old mesh, part of which is gone
        else:
            self.core.state = await anyio.to_thread.run_sync(self._place, self.core.state, mesh)
        seconds = time.monotonic() - started
        self._set_mesh(mesh)
        await self.bus.publish(
            MeshChanged(
                step=self.step,
                source="executor",
                old_shape=mesh_shape(old),
                new_shape=mesh_shape(mesh),
                devices=device_ids(mesh),
                reason=reason,
                needs_restore=needs_restore,
                seconds=seconds,
            )
        )

    async def _restore(self, source: str) -> None:
        """Restore from ``source``: a tier name, or "latest": the newest step any tier holds that verifies,
        from the fastest tier among those that hold it (``elastic_runtime.core.restore``)."""
        assert self.mesh is not None
        started = time.monotonic()
        names = [s.name for s in self.restore_sources]
        if source != "latest" and source not in names:
            await self._fail_recovery(f"restore source {source!r} is not one of {['latest', *names]}")
        candidates = [s for s in self.restore_sources if source in ("latest", s.name)]
        tree, step, position, origin = None, 0, 0, "init"
        try:
            found, snapshot = await anyio.to_thread.run_sync(
                lambda: restore_newest(candidates, self._initial, timeout=self.config.checkpoint_timeout_s)
            )
            tree, step, position, origin = snapshot.tree, snapshot.step, snapshot.data_position, found.name
        except SnapshotUnavailable as exc:
            log.warning("restore: %s", exc)
            if self.step > 0 and self.config.snapshot_every > 0:
                await self._fail_recovery(f"no tier of {names} holds a snapshot to restore step {self.step} from")
        mesh = self.mesh
        state = await anyio.to_thread.run_sync(
            lambda: self._place_initial(mesh) if tree is None else self._place(tree, mesh)
        )
        seconds = time.monotonic() - started
        await self.bus.publish(
            self.core.restored(state, step, data_position=position, restored_from=origin, seconds=seconds)
        )

    async def _run_steps(self, target: int) -> None:
        """Run steps in the worker thread until ``target``, a failure, a command, or ``event_batch_s``.

        Steps run back to back in one thread: a thread hop per step costs more than the runtime's own work
        on a small model. Their events are published when the thread returns, stamped with commit times,
        while the next step computes.
        """
        assert self.mesh is not None
        mesh = self.mesh
        hooks_here = all(not _is_async(hook) for hook in self.hooks)
        if not hooks_here:  # async hooks need the loop: one step per hop
            target = self.step + 1
            if self._hooked != target:
                self._hooked = target
                for hook in self.hooks:
                    result = hook(target)
                    if result is not None:
                        await result
                if self._attention.is_set():
                    return  # a hook asked for something: the boundary applies it before the step runs
        failure = await anyio.to_thread.run_sync(self._steps_in_thread, mesh, target, hooks_here)
        await self._publish_from_threads()
        if failure is not None:
            await self._on_failure(failure[1], failure[0], mesh)

    def _steps_in_thread(self, mesh: Mesh, target: int, run_hooks: bool) -> tuple[int, Exception] | None:
        """Worker thread: commit steps until ``target``; returns (step, error) if one failed.

        One step stays in flight: step N+1 is dispatched (its batch loaded, its program queued on the
        devices) before step N's results are awaited and committed, so that loading, dispatch and the
        bookkeeping of a commit overlap with the devices' work instead of leaving them idle. Step N+1 reads
        N's output (not donated: handlers may read N meanwhile); when N fails, N+1 is awaited and dropped.
        After ``event_batch_s`` the thread returns with N+1 still computing, so that the loop's work on the
        events does not leave the devices idle either. Hooks run once per step number, before it is
        dispatched; once a command is waiting, nothing more is dispatched and the thread returns after
        committing the step in flight.
        """
        deadline = time.perf_counter() + self.config.event_batch_s
        flight, ready = self._computing or (None, 0.0)  # ready: when the previous step's results were complete
        self._computing = None
        # A carried step that is already complete ended at some point while the loop had the events.
        ended_unseen = flight is not None and all(leaf.is_ready() for leaf in jax.tree.leaves(flight.new_state))
        while True:
            following: _InFlight | None = None
            error: tuple[int, Exception] | None = None
            step = (flight.step if flight is not None else self.step) + 1
            if step <= target and not self._attention.is_set():
                state, position = (
                    (flight.new_state, flight.position + 1)
                    if flight is not None
                    else (self.core.state, self.data_position)
                )
                try:
                    if run_hooks and self._hooked != step:
                        self._hooked = step
                        for hook in self.hooks:
                            hook(step)
                    if not self._attention.is_set():
                        following = self._dispatch(state, step, mesh, position)
                except Exception as exc:
                    error = (step, exc)  # reported once the step in flight is committed
            if flight is not None:
                try:
                    done = self._finish(flight, mesh, ready, ended_unseen)
                except Exception as exc:
                    _drain(following)
                    return flight.step, exc
                ready, ended_unseen = time.perf_counter(), False
                self._commit(done, flight.step, mesh)
            if error is not None or following is None:
                return error
            if flight is not None and time.perf_counter() >= deadline:  # a batch has at least one commit
                self._computing = (following, ready)
                return None
            flight = following

    def _commit(self, done: _StepDone, step: int, mesh: Mesh) -> None:
        """The step's new state replaces the old one; its events wait in ``_from_threads``.

        The snapshot is committed before ``self.step`` moves on, so whoever reads ``ctx.step == N`` (a handler
        asking for a checkpoint) finds the snapshot of N in the RAM tier.
        """
        shape = mesh_shape(mesh)
        position = self.data_position + 1

        def keep(_due: tuple[str, ...]) -> None:  # the RAM tier's copy was decided, and queued, at dispatch
            if done.host is None:
                return
            self.ram.commit(
                done.host,
                step=step,
                data_position=position,
                metadata={"mesh": shape} | ({} if done.digest is None else {STATE_DIGEST: f"{done.digest:08x}"}),
                seconds=done.snapshot_wait_s,
                reuse=self.compiler is not None and self.compiler.host_copy,  # fused copies write into spares
                notify=done.verified,  # a state whose replicas were not compared goes to no durable tier
                verified=done.verified,
            )

        self._from_threads.append(
            StepCompleted(
                step=step,
                source="executor",
                duration_s=done.seconds,
                loss=done.loss,
                metrics=done.metrics,
                mesh_shape=shape,
                data_position=position,
                data_s=done.data_s,
                snapshot=done.host is not None,
                snapshot_wait_s=done.snapshot_wait_s,
            )
        )
        noted = self.core.commit(
            step,
            done.state,
            loss=done.loss,
            metrics=done.metrics,
            seconds=done.seconds,
            data_position=position,
            mesh_shape=shape,
            keep=keep,
        )
        self._from_threads.extend(noted.events)

    def _dispatch(self, state: PyTree, step: int, mesh: Mesh, position: int) -> _InFlight:
        """Load the step's batch and queue the compiled step on the devices; does not wait for it.

        The next batch is loaded in the background meanwhile (``data.batch`` runs in one other thread, one
        call at a time); ``data_s`` is only the time this step waited for its batch.
        """
        assert self.compiler is not None
        loading = time.perf_counter()
        host_batch = self._batches.batch(position)
        if self._data_check is not None:
            mismatch = self._data_check.check(position, host_batch, step=step)
            if mismatch is not None:
                log.warning("step %d: %s", step, mismatch.message)
                self._from_threads.append(mismatch)
        data_s = time.perf_counter() - loading
        # The next batch loads from now on, through this step's dispatch and the previous one's commit: on CPU
        # devices the dispatch itself can take half a step, and a batch loaded only after it was often late.
        self._batches.prefetch(position + 1)
        compiler = self.compiler
        if compiler.is_ready(mesh):
            compiled = compiler.get(mesh)
        else:  # compiled here, or waited for: after a failure, part of the recovery's time
            waiting = time.perf_counter()
            compiled = compiler.get(mesh)
            self.core.ledger.recovery.waited_for_compile(time.perf_counter() - waiting)
        snapshot_due = not compiler.host_copy and "ram" in self.core.ledger.due(step)
        copy_due = snapshot_due and not self._by_reference
        if copy_due:  # a copy compiled here (a layout not prepared ahead) is no part of the copy's cost
            self.ram.prepare(state)
        # An executable's first run warms it up: no measure of a step to plan by.
        measured, self._warm_mesh = mesh is self._warm_mesh, mesh
        dispatched = time.perf_counter()
        batch = jax.device_put(host_batch, compiler.batch_shardings(mesh))
        host = None
        if compiler.host_copy:  # the copy is written into a replaced snapshot's buffers, or fresh ones
            buffers = self.ram.take_spare(compiler.host_shardings(mesh))
            buffers = compiler.fresh_buffers(mesh) if buffers is None else buffers
            new_state, metrics, host = self.core.launch(compiled, state, step, batch, buffers)
        else:
            new_state, metrics = self.core.launch(compiled, state, step, batch)
            if snapshot_due and self._by_reference:
                host = new_state
                self.core.ledger.taken("ram", step)
            elif copy_due:
                # Queued now, right behind the step: copied after the next step was dispatched, it waited for
                # that one too and emptied the pipeline (a whole step, where the copy itself is far shorter).
                host = self.ram.dispatch_copy(new_state, step=step)  # None: failed, reported as an event
                if host is not None:  # one that could not be queued is tried again at the next step
                    self.core.ledger.taken("ram", step)
        return _InFlight(step, position, new_state, metrics, host, dispatched, data_s, measured)

    def _finish(self, flight: _InFlight, mesh: Mesh, previous_ready: float, ended_unseen: bool) -> _StepDone:
        """Wait for a dispatched step and its snapshot copy; its duration runs from when the devices could
        start it to its results (at most the average step when it ended unseen, while the loop had the
        thread's events: the rest of that wait is not the step's). A copy of its own that fails is reported
        and leaves the step committed."""
        assert self.compiler is not None
        fused = self.compiler.host_copy
        if fused:
            jax.block_until_ready(flight.host)
        _, loss, metrics = self.core.results(flight.step, flight.new_state, flight.metrics, device_ids(mesh))
        verified, digest = self.integrity is None, None
        if self.integrity is not None and self.integrity.due(flight.step):
            # Raises StateDiverged: the step is not committed, and the recovery replays it (_on_failure).
            healed = self.integrity.check(flight.new_state, flight.step, self.cadence.step_s)
            verified = True
            if healed is not None:
                self._from_threads.append(self._healed(healed, flight.step))
            if flight.host is not None and self.integrity.durable_due(flight.step):
                # What a durable checkpoint of this step is checked against when restored (storage/tier.py).
                digest = state_digest(flight.new_state)
        host, copy_s = flight.host, 0.0
        copied_here = host is not None and not (fused or self._by_reference)  # a copy queued behind the step
        if copied_here:
            try:
                jax.block_until_ready(host)
            except Exception as exc:
                self.ram.report_failure(flight.step, exc)
                host = None
        seconds = time.perf_counter() - max(flight.dispatched, previous_ready)
        if ended_unseen and self.cadence.step_s is not None:
            seconds = min(seconds, self.cadence.step_s)
        plain = not copied_here or self.cadence.step_s is None  # a copy before any plain step counts as none
        if flight.measured and plain:
            self.cadence.stepped(seconds)
        if copied_here:  # what the copy added: the step's time over the average step without one
            extra = seconds - (self.cadence.step_s or seconds)
            if flight.measured:
                self.cadence.copied(extra)  # signed, so that the noise of step times averages out
            copy_s = max(extra, 0.0)
            seconds -= copy_s
        return _StepDone(flight.new_state, loss, metrics, seconds, flight.data_s, copy_s, host, verified, digest)

    def _healed(self, healed: Healed, step: int) -> CorruptionHealed:
        """The replicas agree again at ``step``: healed by the replay, or by evicting the suspects."""
        suspects = healed.divergence.suspects
        return CorruptionHealed(
            step=step,
            source="executor",
            kind="persistent" if healed.persistent else "transient",
            suspects=suspects,
            evicted=suspects if healed.persistent else (),
            seconds=healed.seconds,
        )

    def _snapshot_failed(self, step: int, exc: BaseException) -> None:
        reason = f"host copy failed: {type(exc).__name__}: {exc}"
        self._from_threads.append(
            CheckpointFailed(
                step=step, source="ram", tier="ram", reason=reason, error_type=type(exc).__name__, message=str(exc)
            )
        )

    async def _publish_from_threads(self) -> None:
        while self._from_threads:
            await self.bus.publish(self._from_threads.popleft())

    async def _on_failure(self, exc: Exception, step: int, mesh: Mesh) -> None:
        failed_at = time.monotonic()
        if isinstance(exc, StateDiverged):
            self.ram.fall_back_to_verified()  # the steps after the newest verified state are replayed
        in_mesh = list(mesh.devices.flat)
        healthy = await anyio.to_thread.run_sync(self.health.healthy, in_mesh)
        lost = tuple(sorted(set(device_ids(mesh)) - {d.id for d in healthy}))
        event, started = self.core.ledger.fail(
            exc,
            step=step,
            lost_devices=lost,
            slices=self.policy.slices_of(lost),
            slice_size=self.policy.slice_size,
            at=failed_at,
        )
        await self.bus.publish(event)
        if started is None:
            raise StepError(
                f"step {step} raised {event.error_type} in user code: {event.message} "
                f"(last committed step {self.step} is intact)",
                step=step,
            ) from exc
        self._recovery_deadline = time.monotonic() + self.config.recovery_timeout_s
        self._resumed = False
        if self.core.ledger.over_budget:
            failures = self.core.ledger.recovery.failures
            await self._fail_recovery(f"{failures} failures exceed max_failures={self.config.max_failures}")
        log.warning("step %d failed: %s: %s; waiting for recovery", step, event.error_type, event.message)
        await self.bus.publish(started)

    async def _stop_on_user_error(self, exc: Exception, step: int, what: str) -> NoReturn:
        """An error in the user's code outside a step (init, data, specs, a state transform): StepFailed, and
        the run stops with StepError."""
        event = StepFailed(step=step, source="executor", error_type=type(exc).__name__, message=str(exc))
        await self.bus.publish(event)
        raise StepError(f"{what}: {event.error_type}: {event.message}", step=step) from exc

    async def _fail_recovery(self, reason: str) -> NoReturn:
        await self.bus.publish(self.core.ledger.give_up(reason))
        raise RecoveryError(f"recovery failed at step {self.step}: {reason}", last_committed_step=self.step)
