"""The worker side of a multi-process run: the training loop each process of ``elastic-runtime launch`` runs.

A training script hands its :class:`~runtime.core.job.TrainJob` to :func:`run_worker`; everything else comes from
the controller through the environment (its address, this worker's id, where replica files live) and over
the wire (which group to form, which step to restore from whom).

The layout: ``data`` is the replica axis across slices of processes and ``model`` spans the devices of a
slice's processes (:mod:`storage.shards`); with one process per slice each process holds the whole state. Every
committed step's own shards are copied to host memory (the RAM replica) and, in the background, to a replica
file in ``/dev/shm``; with neighbour replicas, the previous process's shards are copied to host memory too.

Re-forming in-process (measured on jax 0.10.2, CPU, gloo): when a peer is killed, a step blocked in a gloo
collective never returns and raises nothing, even after JAX's own heartbeat timeout. The worker therefore
runs each step in a thread and, when the controller sends :class:`~runtime.cluster.protocol.Form` while a step is still
running, abandons that thread (it stays blocked; it is never joined), shuts ``jax.distributed`` down, clears
the backends and joins the new group. With ``jax_enable_recoverability`` on, this works in the same process.
Because abandoned threads are blocked inside XLA, the process ends with ``os._exit`` after flushing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.cluster.protocol import (
    Failed,
    Finished,
    Form,
    Heartbeat,
    Hello,
    Joined,
    Message,
    Restore,
    Restored,
    Saved,
    Stop,
    Unreadable,
    Warm,
)
from runtime.cluster.tiers import Tier
from runtime.cluster.worker.group import join_group, leave_group
from runtime.cluster.worker.handlers import Boundary, ScriptHandlers
from runtime.cluster.worker.instance import instance_name
from runtime.cluster.worker.link import ControllerLink, Inbound
from runtime.cluster.worker.settings import WorkerSettings
from runtime.core.cadence import EveryN
from runtime.core.classify import classify
from runtime.core.errors import CheckpointInvalid, MeshUnavailable, SnapshotUnavailable, StorageError
from runtime.core.events import StepFailed
from runtime.core.initial import abstract_state, initial_program
from runtime.core.job import PyTree, TrainJob
from runtime.core.keys import with_key_data
from runtime.core.ledger import StepLedger
from runtime.core.memory import resident, return_freed_memory
from runtime.core.process_data import batch_example, local_rows, place_batch
from runtime.core.programs import ProgramStore
from runtime.core.snapshot import HostSnapshot
from runtime.faults.process import attach_worker_faults
from storage.disk import DiskTier
from storage.manifest import describe_leaves
from storage.replicas import MAX_PINS, ReplicaFiles, replica, run_identity
from storage.sharded import ShardedStore, writes
from storage.shards import NeighbourShift, SliceRestore, local_copy, local_like, uses_axis

log = logging.getLogger(__name__)


# How long a step still running when the group re-forms may take to finish before it is abandoned.
_ABANDON_GRACE_S = 0.2
# How long a new group waits for an abandoned restore that may still be reading its shards.
_RESTORE_SETTLE_S = 2.0


class Worker:
    """One worker process's state and loop. Build it with :func:`run_worker`."""

    def __init__(
        self,
        job: TrainJob,
        steps: int,
        *,
        settings: WorkerSettings,
        link: ControllerLink,
        replicas: ReplicaFiles,
        script: ScriptHandlers | None = None,
        programs: ProgramStore | None = None,
    ) -> None:
        # The job as it runs: typed PRNG keys in its state held as key data (runtime.core.keys).
        self.job, self.keys = with_key_data(job)
        return_freed_memory()
        # The training script's own handlers, run at step boundaries (runtime/cluster/worker/handlers.py).
        self.script = script
        if script is not None:
            link.on_notify = script.received
        self.target_steps = steps
        self.settings = settings
        self.worker = settings.worker
        self.link = link
        self.replicas = replicas
        link.on_committed = replicas.committed
        # Called with the step once its result is ready, before it is committed; one that raises (or never
        # returns) stops the step there. Fault injection uses it (runtime.faults.process).
        self.step_checks: list[Callable[[int], None]] = []
        self.generation = 0
        self.layout: dict[str, str] = {}  # which shards this process holds, in every replica's metadata
        self.slice_size = 1  # processes per slice (storage/shards.py)
        self.local_like: PyTree = None  # shapes of this process's shards (storage.shards.local_like)
        self.process_id = -1
        self.num_processes = 0
        self.initialized = False
        # The newest committed step held on the devices (or in ``ram``), its data position, when the durable
        # tier is due. Failures and the budget are the controller's: it counts them for the whole group.
        self.ledger = StepLedger("worker")
        self.step_time_s: float | None = None
        self.ram: HostSnapshot | None = None  # the RAM replica: host copy of the newest committed step
        # With neighbour replicas: the previous process's shards of the same step, and the permute that moves them.
        self.neighbour: HostSnapshot | None = None
        self.shift: NeighbourShift | None = None
        self.restorer: SliceRestore | None = None  # the group's restore, compiled at forming
        self.initial: Callable[[], PyTree] | None = None  # makes the initial state on the group's mesh (initial.py)
        # While joining: the steps its replica files hold, with the folders holding each (read only if restored),
        # and the tier they are in ("shm" or "disk").
        self.files: dict[int, list[DiskTier]] = {}
        self.files_tier = Tier.SHM if str(replicas.directory).startswith("/dev/shm") else Tier.DISK
        # The group's durable checkpoints (storage/sharded.py), when the controller keeps them.
        self.durable: ShardedStore | None = None
        self.durable_steps: set[int] = set()  # committed durable steps of this run (read at joining)
        self._writes: list[bool] = []  # per leaf: whether this process writes its shards there
        self._durable_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="durable")
        self._durable_write: Future[None] | None = None
        # Shapes and dtypes only: no process (a spare included) holds the whole state (runtime/core/initial.py).
        self.template: PyTree = abstract_state(self.job)
        self.batch_like: PyTree = batch_example(self.job.data)  # a global batch's shapes
        self.batch_rows = (0, 0)  # this process's rows of each global batch on the group's mesh
        self.batch_bytes = 0  # bytes read from the data source for the last step
        # Written into every replica, and required of any replica restored: another run's (or job's) files in
        # the same folder are never taken for ours.
        self.identity = run_identity(settings.run_id, self.template, steps) if settings.run_id else {}
        self._skipped: tuple[str, ...] = ()  # replica files the last read would not restore, for Joined
        self.fences: dict[int, int] = {}  # superseded generations' fences, from the newest Form
        self.mesh: Any = None
        self.compiled: Any = None
        self.state_shardings: Any = None
        self.batch_shardings: Any = None
        self.state: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
        # The compiled step, snapshot and restore programs of every layout this process was in, kept to be
        # loaded, not traced, when a later group has the same layout (runtime/core/programs.py).
        self.programs = programs if programs is not None else ProgramStore(keep=False)
        self._deferred: Form | Stop | None = None  # a planned re-forming (or drain), due after its ``at_step``
        # A restore left running when the group re-formed: it may still be reading, and must not build arrays on
        # the next group's backend (see ``_form``).
        self._abandoned_restore: Future[Any] | None = None
        self._durable_last = -1  # the step of the newest durable write started
        self.held = False  # told to stop stepping (``Stop.hold``): the run is draining
        self.stopped_by: Stop | None = None  # the Stop it exits on

    @property
    def step(self) -> int:
        return self.ledger.step

    # --- the loop ----------------------------------------------------------------------------------------

    def serve(self) -> int:
        """Handle controller messages until told to stop; returns the exit code."""
        events = self.script.events if self.script is not None else ()
        where = instance_name(self.settings)
        self.link.send(
            Hello(worker=self.worker, pid=os.getpid(), target_steps=self.target_steps, events=events, instance=where)
        )
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        pending: Inbound | None = None
        while True:
            message = pending if pending is not None else self.link.inbox.get()
            pending = None
            match message:
                case Form():
                    self._form(message)
                case Restore() if message.generation == self.generation:
                    # The restore is a collective too: if a peer dies during it, abandon it like a step. Its
                    # thread only returns what it restored; the worker's state is set here, by this thread.
                    abandoned = threading.Event()
                    future = self._pool.submit(self._restore, message, self.files, abandoned)
                    self.files = {}
                    outcome = self._await(future, what=f"the restore of step {message.step}")
                    if isinstance(outcome, Message):
                        abandoned.set()
                        self._abandoned_restore = future
                        pending = outcome
                    elif outcome is not None:
                        self._restored(message, outcome[0])
                        # Held here through training, the restored state and its host copy were two more
                        # copies of this process's shards for the whole run (docs/multiprocess.md, memory).
                        del outcome, future
                        pending = self._train(message.target_steps)
                case Restore():
                    log.info("stale restore for generation %d ignored", message.generation)
                case Warm(programs=programs) if not self.initialized:
                    self._warm(programs)
                case Warm():
                    pass
                case Stop(hold=True):
                    log.info("worker %d holds at step %d: %s", self.worker, self.step, message.reason)
                    self.held = True
                    self._heartbeat()  # says the step it holds at
                case Stop(reason=reason, exit_code=code):
                    log.info("worker %d stops (exit code %d): %s", self.worker, code, reason)
                    self.stopped_by = message
                    if message.durable_step >= 0:
                        self._final_durable(message.durable_step)
                    return code

    def _beat(self) -> None:
        while True:
            self._heartbeat()
            time.sleep(self.settings.heartbeat_s)

    def _heartbeat(self) -> None:
        self.link.send(
            Heartbeat(
                worker=self.worker,
                generation=self.generation,
                step=self.step,
                step_time_s=self.step_time_s,
                sent_at=time.time(),
                held=self.held,
                memory=self._memory(),
            )
        )

    def _memory(self) -> dict[str, int]:
        """Resident memory and host copies, for the heartbeat (read from the heartbeat's thread: a copy replaced
        meanwhile is counted as the one it replaced, the same size)."""
        ram, neighbour = self.ram, self.neighbour
        copies = {"ram": ram.nbytes if ram is not None else 0, "neighbour": neighbour.nbytes if neighbour else 0}
        return resident() | copies | {"batch": self.batch_bytes}

    # --- forming a group ---------------------------------------------------------------------------------

    def _form(self, form: Form) -> None:
        import jax
        import jax.extend.backend

        from runtime.core.compiler import StepCompiler

        started = time.monotonic()
        self._deferred = None
        if form.run_id and not self.identity:
            # Started by a cluster, not by launch: the run's id comes with the first Form, before any replica
            # is read or written, so that only this run's replicas are ever restored here too.
            self.identity = run_identity(form.run_id, self.template, self.target_steps)
        self.fences = dict(form.fences)
        if form.faults:
            attach_worker_faults(self, form.faults)
        if self._abandoned_restore is not None:
            # Reading files, it ends soon (and then stops before touching JAX); blocked in a collective, never.
            with contextlib.suppress(Exception):
                self._abandoned_restore.result(timeout=_RESTORE_SETTLE_S)
            self._abandoned_restore = None
        if self.initialized:
            leave_group()
            jax.extend.backend.clear_backends()
            self.state = None  # it lived on the old backend
        left = time.monotonic()
        join_group(form, self.settings)
        if jax.process_count() != form.num_processes:
            # Another thread asked JAX between leaving the old group and joining this one, which brought up a
            # backend outside any group: drop it, so the next call brings up the group's.
            log.warning("worker %d: a backend outside the group was up; cleared", self.worker)
            jax.extend.backend.clear_backends()
        connected = time.monotonic()
        self.programs.reset(self.replicas.directory / form.programs if form.programs else None)
        self.initialized = True
        self.generation, self.process_id, self.num_processes = form.generation, form.process_id, form.num_processes
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        # The replica axis spans the slices; the other axes span the devices of every process of a slice (with
        # one process per slice, the devices of that process).
        slices = form.num_processes // form.slice_size
        process_mesh = self.job.process_mesh
        try:
            self.mesh = process_mesh.build(devices, slices)
        except MeshUnavailable as exc:
            self._report_failure("JobUnsupported", str(exc), "", step=self.step, unsupported=True)
            return
        place = (form.process_id, form.num_processes)
        compiler = StepCompiler(self.job, self.template, self.batch_like, programs=self.programs, place=place)
        self.state_shardings = compiler.state_shardings(self.mesh)
        self.batch_shardings = compiler.batch_shardings(self.mesh)
        self.batch_rows = local_rows(self.batch_shardings, self.batch_like)  # this mesh's rows (process_data.py)
        replica = process_mesh.replica_axis
        over_replica = uses_axis(self.state_shardings, self.template, replica)
        if over_replica:
            # The replica axis shrinks when a slice is lost: a state split over it would lose shards with it.
            names = ", ".join(over_replica[:3]) + (
                f" and {len(over_replica) - 3} more" if len(over_replica) > 3 else ""
            )
            message = (
                f"the state is sharded across processes over the {replica!r} axis: {names}; {replica!r} is the "
                "replica axis across slices, which shrinks when one is lost: shard the state over the axes inside "
                f"a slice ({', '.join(map(repr, process_mesh.slice_axes))}), which span its processes (launch --slices)"
            )
            self._report_failure("JobUnsupported", message, "", step=self.step, unsupported=True)
            return
        position, local = form.process_id % form.slice_size, self.settings.local_devices
        layout = f"position {position} of {form.slice_size} x {local} devices"
        if self.ram is not None and self.ram.metadata.get("layout") != layout:
            # Seated elsewhere in a slice: the shards it holds are not the ones it needs now.
            self.ram = self.neighbour = None
        self.layout = {"layout": layout}
        self.slice_size = form.slice_size
        self.local_like = local_like(self.template, self.state_shardings)
        if form.durable_dir and (self.durable is None or self.durable.location != form.durable_dir.rstrip("/")):
            self.durable = ShardedStore(form.durable_dir)
        self.ledger.policies = {"durable": EveryN(form.durable_every)} if form.durable_every > 0 else {}
        self._writes = writes(self.template, self.state_shardings, form.slice_size)
        self.compiled = compiler.get(self.mesh)
        shift = form.neighbour_replicas
        kept = self.programs
        self.shift = (
            NeighbourShift(self.template, self.state_shardings, replica=replica, programs=kept) if shift else None
        )
        self.restorer = SliceRestore(
            self.template, self.state_shardings, neighbours=shift, replica=replica, programs=kept
        )
        if self.shift is None:
            self.neighbour = None
        # A process that never held a step may start from the initial state: its program is compiled (or loaded)
        # here, in the join's time, not in the restore's, which the hang monitor times.
        fresh = self.ram is None and self.step == 0
        self.initial = (
            initial_program(self.job, self.state_shardings, self.mesh, programs=kept, place=place) if fresh else None
        )
        compiled = time.monotonic()
        best, tier = self._best_local(form.read_files)
        kept = self.programs
        phases = {"leave": left - started, "connect": connected - left, **kept.seconds}
        phases["read"] = time.monotonic() - compiled
        log.info(
            "joined generation %d as process %d/%d in %.3f s: %s; traced %s, loaded %s",
            form.generation,
            form.process_id,
            form.num_processes,
            time.monotonic() - started,
            ", ".join(f"{phase} {seconds:.3f} s" for phase, seconds in phases.items()),
            ", ".join(kept.traced) or "nothing",
            ", ".join(kept.loaded) or "nothing",
        )
        self.link.send(
            Joined(
                worker=self.worker,
                generation=self.generation,
                best_step=best,
                tier=tier,
                steps=tuple(sorted(self._local_steps() | self.durable_steps)),
                durable_only=tuple(sorted(self.durable_steps - self._local_steps())),
                neighbour_step=self.neighbour.step if self.neighbour is not None else 0,
                join_s=time.monotonic() - started,
                skipped=self._skipped,
                phases=phases,
                traced=tuple(kept.traced),
                mesh_shape={str(name): int(size) for name, size in self.mesh.shape.items()},
            )
        )

    def _warm(self, programs: str) -> None:
        """Trace and compile the step once on a local, non-distributed backend, then drop that backend.

        The first compile in a process pays for loading and initializing XLA's compiler and JAX's tracing
        machinery (seconds here); a spare that paid it while idle joins a re-forming group sooner. Where the
        run's kept ``programs`` are on this host already, joining loads them: only the backend is brought up
        (a fraction of a second), since a real model's warm-up compile (minutes on CPU) keeps the spare deaf
        to the Form of a group that needs it.
        """
        import jax
        import jax.extend.backend

        from runtime.core.compiler import StepCompiler

        started = time.monotonic()
        kept = self.replicas.directory / programs if programs else None
        try:
            if kept is not None and kept.is_dir() and any(kept.iterdir()):
                jax.block_until_ready(jax.jit(lambda x: x + 1)(np.float32(0)))
                log.info("the run's programs are kept on this host: only the backend warmed up")
                return
            mesh = self.job.process_mesh.build(jax.local_devices(), 1)
            StepCompiler(self.job, self.template, self.batch_like).get(mesh)
        except Exception as exc:  # only an optimization: a spare that cannot warm up joins cold
            log.warning("warm-up failed: %s: %s", type(exc).__name__, exc)
        finally:
            jax.extend.backend.clear_backends()
        log.info("warmed up in %.3f s", time.monotonic() - started)

    def _best_local(self, read_files: bool) -> tuple[int, Tier]:
        """The newest step this process can restore and from where. The steps its replica files hold go in
        ``files`` (only their manifests are read here: the data of the one restored is read by ``_restore``),
        the group's committed durable checkpoints in ``durable_steps``."""
        self.files = {}
        if read_files:  # a restarted worker, a resumed run, or a slice that may need to roll back
            try:
                self.files = self.replicas.listed(
                    self.identity | self.layout,
                    max_step=self.target_steps,
                    fences=self.fences,
                    # One process a slice: its newest is its slice's best. Else an older step may be the one
                    # the whole slice holds (a peer's newest write did not finish, or only the durable tier
                    # holds a lost process's shards): the keep=2 newest and those pinned for durable steps.
                    limit=1 if self.slice_size == 1 else 2 + MAX_PINS,
                )
            finally:
                self._skipped = tuple(self.replicas.skipped)
        self.durable_steps = self._durable_steps()
        if self.ram is not None:
            return self.ram.step, Tier.RAM
        if self.files:
            return max(self.files), self.files_tier
        if self.durable_steps:
            return max(self.durable_steps), Tier.DURABLE
        return 0, Tier.NONE

    def _local_steps(self) -> set[int]:
        """The steps it can restore from its own memory or replica files."""
        return set(self.files) | ({self.ram.step} if self.ram is not None else set())

    def _durable_steps(self) -> set[int]:
        """This run's committed durable checkpoints (any layout: every process reads its own shards)."""
        if self.durable is None:
            return set()
        found = set()
        try:
            steps = self.durable.steps()
        except StorageError as exc:  # unreachable now: the group restores from what else it holds
            log.warning("cannot list the durable checkpoints: %s", exc)
            return set()
        for step in steps:
            try:
                metadata = self.durable.manifest(step).metadata
            except (CheckpointInvalid, SnapshotUnavailable, StorageError) as exc:
                log.warning("durable checkpoint of step %d not usable: %s", step, exc)
                continue
            fence = self.fences.get(int(metadata.get("generation", "0")))
            if fence is not None and step > fence:
                log.warning("durable checkpoint of step %d: its generation was fenced at step %d; skipped", step, fence)
            elif step <= self.target_steps and all(metadata.get(k) == v for k, v in self.identity.items()):
                found.add(step)
        return found

    def _restore(
        self, restore: Restore, files: dict[int, list[DiskTier]], abandoned: threading.Event
    ) -> tuple[_Restoration, float]:
        """Read this process's shards of ``restore.step`` (when the source slice needs them) and take part in the
        group's restore. Runs in the step thread and changes nothing of the worker's: ``_restored`` does."""
        import jax

        if restore.source < 0:
            state = (self.initial or initial_program(self.job, self.state_shardings, self.mesh))()
            return _Restoration(state, 0, local_copy(state), Tier.NONE, 0, None), 0.0
        # Only the source slice's shards are read: the other slices' would be thrown away. A process of it
        # whose shards are in its neighbour's RAM takes them from there.
        in_source = self.process_id // self.slice_size == restore.source
        takes = in_source and self.process_id % self.slice_size in restore.from_neighbour
        tier: Tier = Tier.NONE
        mine = None
        if takes:
            tier = Tier.NEIGHBOUR
        elif in_source:
            tier, mine = self._read_own(restore, files)
        if abandoned.is_set():  # the group re-formed while this read: the backend is no longer this group's
            raise RuntimeError(f"the restore of step {restore.step} was abandoned")
        spare = self.neighbour if self.neighbour is not None and self.neighbour.step == restore.step else None
        assert self.restorer is not None
        # Every member takes its shards from the source slice, its own included: every member then holds
        # exactly the source's values, whichever tier each one held.
        state, position = self.restorer(
            mine.tree if mine is not None else None,
            mine.data_position if mine is not None else 0,
            source=restore.source,
            neighbour=spare.tree if spare is not None else None,
            neighbour_position=spare.data_position if spare is not None else -1,
            from_neighbour=bool(restore.from_neighbour),
        )
        jax.block_until_ready(state)
        if mine is not None:
            boxes, nbytes = mine.tree, mine.nbytes
        else:  # what came from the neighbour's copy counts as delivered by it; a non-source member's, as nothing
            boxes = local_copy(state)
            nbytes = sum(leaf.nbytes for leaf in _leaves(boxes)) if takes else 0
        return _Restoration(state, position, boxes, tier, nbytes, spare), 0.0

    def _restored(self, restore: Restore, done: _Restoration) -> None:
        """The group's restore finished: the worker holds its step (and the neighbour copy of it it kept)."""
        self.state, self.neighbour = done.state, done.neighbour
        # Its StateRestored is dropped: the controller publishes the group's, timed there.
        self.ledger.restored(restore.step, data_position=done.position, restored_from=done.tier, seconds=0.0)
        self.ram = replica(
            restore.step, done.position, done.boxes, self.identity | self.layout, generation=restore.generation
        )
        restored = Restored(
            worker=self.worker, generation=restore.generation, step=restore.step, tier=done.tier, nbytes=done.nbytes
        )
        self.link.send(restored)
        self._heartbeat()

    def _read_own(self, restore: Restore, files: dict[int, list[DiskTier]]) -> tuple[Tier, HostSnapshot]:
        """This process's shards of the step, from the fastest tier holding them that verifies: RAM, its replica
        files, the durable tier. Each one that fails its checksums is reported (``Unreadable``); when all fail,
        CheckpointInvalid is raised, and the controller re-forms from another step: never a partial state."""
        step = restore.step
        if self.ram is not None and self.ram.step == step:
            return Tier.RAM, self.ram
        sources: list[tuple[Tier, Callable[[], HostSnapshot]]] = []
        if step in files:
            sources.append((self.files_tier, lambda: self.replicas.read(step, files[step], self.local_like)))
        if step in self.durable_steps:
            sources.append((Tier.DURABLE, lambda: self._read_durable(step)))
        failures: list[tuple[Tier, CheckpointInvalid]] = []
        for tier, read in sources:
            try:
                snapshot = read()
            except CheckpointInvalid as exc:
                failures.append((tier, exc))
                continue
            self._unreadable(restore, failures, recovered_from=tier)
            return tier, snapshot
        if not failures:  # the plan counted on this process, which said it holds the step
            where = str(self.replicas.directory)
            failures.append((Tier.NONE, CheckpointInvalid(f"step {step} not held", path=where, reason="not held")))
        self._unreadable(restore, failures, recovered_from=None)
        raise failures[-1][1]

    def _unreadable(
        self, restore: Restore, failures: list[tuple[Tier, CheckpointInvalid]], *, recovered_from: Tier | None
    ) -> None:
        for tier, exc in failures:
            log.error("step %d unreadable from %s: %s", restore.step, tier, exc)
            unreadable = Unreadable(
                worker=self.worker,
                generation=restore.generation,
                step=restore.step,
                tier=tier,
                path=exc.path,
                reason=exc.reason,
                recovered_from=recovered_from,
            )
            self.link.send(unreadable)

    def _read_durable(self, step: int) -> HostSnapshot:
        """This process's shards of durable checkpoint ``step``, only the bytes they need, verified."""
        assert self.durable is not None
        manifest = self.durable.manifest(step)
        boxes, nbytes = self.durable.read(step, manifest, self.template, self.state_shardings, process=self.process_id)
        snapshot = replica(step, manifest.data_position, boxes)
        snapshot.nbytes = nbytes
        return snapshot

    def _save_durable(self, *, final: bool, snapshot: HostSnapshot | None = None) -> None:
        """Write this process's part of the durable checkpoint of the step just committed (or of ``snapshot``),
        in the background; a step whose predecessor's write is still running is not written (the next due one
        is), except the ``final`` one, which waits for it."""
        assert self.ram is not None and self.durable is not None
        if self._durable_write is not None and not self._durable_write.done() and not final:
            log.info("durable checkpoint of step %d skipped: the previous write is still running", self.step)
            return
        # Captured here: the write runs on while a re-forming group may be without a backend (see write_part).
        snapshot, generation, process = snapshot or self.ram, self.generation, self.process_id
        lead, self._durable_last = self.process_id == 0, snapshot.step
        owned, shardings, store = self._writes, self.state_shardings, self.durable

        def write() -> None:
            files = store.write(
                snapshot.step, snapshot.tree, self.template, shardings, owned=owned, lead=lead, process=process
            )
            structure, leaves = describe_leaves(self.template) if lead else ("", ())
            saved = Saved(
                worker=self.worker,
                generation=generation,
                step=snapshot.step,
                data_position=snapshot.data_position,
                files=tuple(files),
                structure=structure,
                leaves=leaves,
                metadata=self.identity if lead else {},
            )
            self.link.send(saved)

        self._durable_write = self._durable_pool.submit(write)
        self._durable_write.add_done_callback(_log_failure)

    def _final_durable(self, step: int) -> None:
        """The drain's durable checkpoint (``Stop.durable_step``): this process's part of ``step``, its newest
        committed step or, when a peer held one step behind, the one before from its replica file; written (and
        its ``Saved`` sent) before the process exits."""
        if self.durable is None or self.ram is None or self.process_id >= self.slice_size:
            return  # not a writer of the group's checkpoints
        if self._durable_write is not None:
            with contextlib.suppress(Exception):  # a failure was logged by _log_failure
                self._durable_write.result()
            if self._durable_last == step:
                return  # written already: its Saved is out
        snapshot: HostSnapshot | None = self.ram
        if self.ram.step != step:
            self.replicas.wait()
            try:
                snapshot = self.replicas.read(step, [self.replicas.tier], self.local_like)
            except CheckpointInvalid as exc:
                log.error("worker %d: no replica of step %d for the final checkpoint: %s", self.worker, step, exc)
                return
        log.info("worker %d writes its part of the final durable checkpoint of step %d", self.worker, step)
        self._save_durable(final=True, snapshot=snapshot)
        assert self._durable_write is not None
        with contextlib.suppress(Exception):
            self._durable_write.result()

    # --- training ----------------------------------------------------------------------------------------

    def _train(self, target: int) -> Inbound | None:
        """Run steps until ``target``, or until the controller sends something; returns that message."""
        assert self.ram is not None
        position = self.ledger.data_position
        while self.step < target:
            if self._deferred is not None and self.step >= self._deferred.at_step:
                form, self._deferred = self._deferred, None
                return form
            if not self.link.inbox.empty():
                message = self.link.inbox.get()
                if not self._defer(message):
                    return message
            if not self.link.leased():
                heard = self._fenced()
                if heard is not None:
                    return heard
            if self.script is not None:
                handled = self._await(self._pool.submit(self.script.boundary, self), what="the script's handlers")
                if isinstance(handled, Message) or handled is None or handled[0].stop:
                    return handled if isinstance(handled, Message) else None
                self._apply(handled[0])
            future = self._pool.submit(self._run_step, self.state, position, self.step + 1)
            outcome = self._await(future, users_code=True)
            if isinstance(outcome, Message):
                return outcome
            if outcome is None:  # the step raised: not committed; wait for the controller to re-form
                return None
            (new_state, moved), seconds = outcome
            self.state, self.step_time_s = new_state, seconds
            step, position = self.step + 1, position + 1
            own = local_copy(new_state)
            self.ram = replica(step, position, own, self.identity | self.layout, generation=self.generation)
            if self.shift is not None:
                self.neighbour = replica(step, position, self.shift.copy(moved, own), generation=self.generation)
            leased = self.link.leased()  # cut off, this worker may have been replaced: its files must not compete
            if leased:
                self.replicas.save(self.ram)  # after the previous step's file is written
            # Committed, and so named in the heartbeats, only now: a group that counts this step committed then
            # finds the step before it in every member's files. (Counted before the wait, a member killed there
            # left files two steps behind its peers', which keep two: no step was whole in the slice any more.)
            due = self.ledger.commit(step, data_position=position).due
            if leased and self.durable is not None and "durable" in due:
                self.replicas.pin(self.step)
                if self.process_id < self.slice_size:  # the first slice writes the group's checkpoint
                    self._save_durable(final=self.step == target)
            self._heartbeat()
        # The gather is a collective: a peer lost now must not leave this worker deaf to the next Form.
        outcome = self._await(self._pool.submit(self._gather_whole), what="the final gather")
        if isinstance(outcome, Message) or outcome is None:
            return outcome
        self._finish(target, outcome[0])
        return None

    def _apply(self, done: Boundary) -> None:
        """What the script's handlers asked at this boundary: a new state, a durable checkpoint of the step."""
        if done.state is not None:
            self.state = done.state
        if done.checkpoint and self.durable is not None and self.link.leased():
            cadence = self.ledger.policies.get("durable")
            if self.step in self.durable_steps or (
                cadence is not None and cadence.should_save(self.step, self.step - 1)
            ):
                # Written (or due) already: writing a committed step's files again could damage it.
                log.info("checkpoint asked for at step %d: it is a durable step already", self.step)
                return
            self.ledger.taken("durable", self.step)
            self.replicas.pin(self.step)
            if self.process_id < self.slice_size:  # the first slice writes the group's checkpoint
                self._save_durable(final=False)

    def _fenced(self) -> Inbound | None:
        """The lease ran out: no step and no replica write until the controller is heard again. Returns its
        next message (a Form, a Stop), or None when only the lease was renewed (a short blip)."""
        log.warning(
            "worker %d: no lease from the controller; stopped stepping and writing replicas at step %d",
            self.worker,
            self.step,
        )
        while True:
            try:
                message = self.link.inbox.get(timeout=0.1)
            except queue.Empty:
                if self.link.leased():
                    log.warning("worker %d: lease renewed; stepping again", self.worker)
                    return None
                continue
            if not self._defer(message):  # a planned re-forming waits for its step, as in _train
                return message

    def _await(
        self, future: Future[tuple[Any, float]], *, users_code: bool = False, what: str = ""
    ) -> tuple[Any, float] | Inbound | None:
        """The step's result; a controller message if one came while the step hung; None if the step raised.
        ``users_code``: the future runs the user's data and step, whose own errors end the run. ``what``: what
        the future does, for the log (default: the next step)."""
        what = what or f"step {self.step + 1}"
        lapsed = False
        while True:
            try:
                return future.result(timeout=0.02)
            except FutureTimeout:
                if not self.link.leased() and not lapsed:
                    lapsed = True  # a step blocked in a collective cannot be stopped; its replica is not written
                    log.warning("worker %d: no lease from the controller during step %d", self.worker, self.step + 1)
                if self.link.inbox.empty() or self._defer_head():
                    continue
            except Exception as exc:
                if users_code and isinstance(classify(exc, step=self.step + 1, in_group=True), StepFailed):
                    # The same data and program would fail again in any group: the run ends, not this worker.
                    log.exception("step %d failed in the user's code; reporting it to the controller", self.step + 1)
                    self._report_failure(type(exc).__name__, str(exc), traceback.format_exc(), step=self.step + 1)
                else:
                    log.error("%s failed: %s: %s; waiting for the group to re-form", what, type(exc), exc)
                return None
            try:
                return future.result(timeout=_ABANDON_GRACE_S)
            except FutureTimeout:
                # Blocked in a collective with a dead peer: gloo never returns. Leave the thread behind.
                log.warning("abandoning %s, blocked in a collective; re-forming", what)
                self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step")
                return self.link.inbox.get()
            except Exception:
                return self.link.inbox.get()

    def _report_failure(
        self, error_type: str, message: str, trace: str, *, step: int, unsupported: bool = False
    ) -> None:
        """Tell the controller the run cannot go on; it stops every worker (this one waits for its Stop)."""
        failed = Failed(
            worker=self.worker,
            generation=self.generation,
            step=step,
            error_type=error_type,
            message=message,
            traceback=trace[-4000:],  # the end of a traceback names the failing line
            unsupported=unsupported,
        )
        self.link.send(failed)

    def _defer(self, message: Inbound) -> bool:
        """Keep a planned Form (``at_step`` ahead) for its step boundary; True if ``message`` was kept."""
        if isinstance(message, Form | Stop) and message.at_step > self.step:
            self._deferred = message
            return True
        return False

    def _defer_head(self) -> bool:
        """While a step runs: take a planned Form off the inbox (the step must finish); True if one was."""
        with self.link.inbox.mutex:
            head = self.link.inbox.queue[0] if self.link.inbox.queue else None
        if isinstance(head, Form | Stop) and head.at_step > self.step:
            return self._defer(self.link.inbox.get())
        return False

    def _run_step(self, state: PyTree, position: int, step: int) -> tuple[PyTree, float]:
        import jax

        started = time.perf_counter()
        batch, self.batch_bytes = place_batch(
            self.job.data, position, self.batch_shardings, self.batch_like, self.batch_rows
        )
        new_state, _metrics = self.compiled(state, batch)
        jax.block_until_ready(new_state)
        for check in self.step_checks:
            check(step)
        # The neighbour replica's permute is a collective too: it runs here, where a dead peer's hang is abandoned.
        moved = self.shift(new_state) if self.shift is not None else []
        if self.settings.step_delay_s:
            time.sleep(self.settings.step_delay_s)
        return (new_state, moved), time.perf_counter() - started

    def _gather_whole(self) -> tuple[tuple[str, PyTree | None], float]:
        """The final state's digest, gathered from every slice's shards (a collective: every member finishes
        together), once this process's part of the final durable checkpoint is out (``Saved`` before
        ``Finished``, so the controller commits it). Only the process that writes the result keeps the whole
        state (returned with the digest); the others hash each leaf and let it go."""
        import jax
        from jax.experimental import multihost_utils

        if self._durable_write is not None:
            with contextlib.suppress(Exception):  # a failure was logged by _log_failure
                self._durable_write.result()
        # Leaf by leaf: gathered at once, every worker held two more copies of the whole state (one per local
        # device), and hashing one joined copy two more: at a GB of state 4 workers ran the machine out of memory.
        keep = bool(self.settings.result) and self.process_id == 0
        hasher = hashlib.sha256()
        kept: list[np.ndarray] = []
        for leaf in _leaves(self.state):
            whole = np.ascontiguousarray(multihost_utils.process_allgather(leaf, tiled=True))
            hasher.update(whole.reshape(-1).view(np.uint8).data)
            if keep:
                kept.append(whole)
            del whole
        tree = jax.tree.unflatten(jax.tree.structure(self.state), kept) if keep else None
        return (hasher.hexdigest(), tree), 0.0

    def _finish(self, target: int, gathered: tuple[str, PyTree | None]) -> None:
        assert self.ram is not None
        digest, whole = gathered
        result = self.settings.result
        if result and whole is not None:  # in the disk tier's format: verified, and plain Orbax reads it
            final = replica(target, self.ram.data_position, whole, self.identity)
            DiskTier(result, name="result", check_space=False).save(final, timeout=600.0)
        self.link.send(Finished(worker=self.worker, generation=self.generation, step=target, digest=digest))


@dataclass
class _Restoration:
    """What a restore gives a worker: the state on its devices, its data position, this process's boxes of it,
    and where they came from."""

    state: PyTree
    position: int
    boxes: PyTree
    tier: Tier
    nbytes: int
    neighbour: HostSnapshot | None  # the neighbour copy of the restored step it keeps, if any


def _log_failure(future: Future[None]) -> None:
    exc = future.exception()
    if exc is not None:  # a failed write leaves the previous checkpoint; the controller commits nothing new
        log.error("durable checkpoint write failed: %s: %s", type(exc).__name__, exc)


def _leaves(tree: PyTree) -> list[Any]:
    import jax

    return list(jax.tree.leaves(tree))
