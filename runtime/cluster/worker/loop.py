"""The worker side of a multi-process run: the loop each process of ``elastic-runtime launch`` runs.

A training script hands its :class:`~elastic_runtime.core.job.TrainJob` to :func:`run_worker`; everything else comes
from the controller through the environment (its address, this worker's id, where replica files live) and over
the wire (which group to form, which step to restore from whom).

The layout: ``data`` is the replica axis across slices of processes and ``model`` spans the devices of a
slice's processes (:mod:`elastic_runtime.storage.boxes`); with one process per slice each process holds the whole
state. Every committed step's own shards are copied to host memory (the RAM replica) and, in the background, to a
replica file in ``/dev/shm``; with neighbour replicas, the previous process's shards are copied to host memory too.

Re-forming in-process (measured on jax 0.10.2, CPU, gloo): when a peer is killed, a step blocked in a gloo
collective never returns and raises nothing, even after JAX's own heartbeat timeout. The worker therefore
runs each step in a thread and, when the controller sends :class:`~elastic_runtime.cluster.protocol.Form` while a step
is still running, abandons that thread (it stays blocked; it is never joined), shuts ``jax.distributed`` down, clears
the backends and joins the new group. With ``jax_enable_recoverability`` on, this works in the same process.
Because abandoned threads are blocked inside XLA, the process ends with ``os._exit`` after flushing.

This module holds the :class:`Worker`'s state, its message loop and its heartbeat; what each message starts is in
its own module, a function over the worker: ``forming`` (joining a group), ``restore`` (what it holds and the
group's restore), ``training`` (the steps and their commit), ``stepping`` (the step thread it may abandon) and
``durable`` (its part of the durable checkpoints).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from elastic_runtime.cluster.collectives import NeighbourShift, SliceRestore
from elastic_runtime.cluster.protocol import EventReport, Form, Heartbeat, Hello, Message, RestoreStep, Stop, Warm
from elastic_runtime.cluster.tiers import Tier
from elastic_runtime.cluster.worker.durable import durable_lane, final_durable
from elastic_runtime.cluster.worker.forming import form_group, warm_up
from elastic_runtime.cluster.worker.group import leave_group
from elastic_runtime.cluster.worker.handlers import ScriptHandlers
from elastic_runtime.cluster.worker.instance import instance_name
from elastic_runtime.cluster.worker.leaving import leave_on_signal
from elastic_runtime.cluster.worker.link import ControllerLink, Inbound
from elastic_runtime.cluster.worker.pace import Pace
from elastic_runtime.cluster.worker.restore import adopt_restored, restore_step
from elastic_runtime.cluster.worker.settings import WorkerSettings
from elastic_runtime.cluster.worker.smaller import SmallerGroup
from elastic_runtime.cluster.worker.spares import SpareStates
from elastic_runtime.cluster.worker.stepping import StepThread, await_step
from elastic_runtime.cluster.worker.training import train
from elastic_runtime.core.events import StepFailed
from elastic_runtime.core.executor import RunResult
from elastic_runtime.core.initial import abstract_state
from elastic_runtime.core.job import PyTree, TrainJob
from elastic_runtime.core.keys import with_key_data
from elastic_runtime.core.ledger import StepLedger
from elastic_runtime.core.memory import resident, return_freed_memory
from elastic_runtime.core.process_data import batch_example
from elastic_runtime.core.programs import ProgramStore
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.replicas import ReplicaFiles, run_identity
from elastic_runtime.storage.sharded import ShardedStore

log = logging.getLogger(__name__)

# A heartbeat this late is logged: with the 0.2 s interval its silence is then past half the controller's 0.8 s
# default timeout, and the log says whether a worker declared silent had stopped sending (its heartbeat thread
# waited for the GIL or a CPU) or was read late.
_LATE_BEAT_S = 0.2


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
        script_settings: dict[str, str] | None = None,
    ) -> None:
        # The job as it runs: typed PRNG keys in its state held as key data (elastic_runtime.core.keys).
        self.job, self.keys = with_key_data(job)
        if settings.return_freed_memory:
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
        link.on_committed = self._durable_committed
        # Called with the step once its result is ready, before it is committed; one that raises (or never
        # returns) stops the step there. Fault injection uses it (elastic_runtime.faults.process).
        self.step_checks: list[Callable[[int], None]] = []
        self.generation = 0
        self.layout: dict[str, str] = {}  # which shards this process holds, in every replica's metadata
        self.slice_size = 1  # processes per slice (storage/boxes.py)
        self.local_like: PyTree = None  # shapes of this process's shards (elastic_runtime.storage.boxes.local_like)
        self.process_id = -1
        self.num_processes = 0
        self.initialized = False
        # The newest committed step held on the devices (or in ``ram``), its data position, when the durable
        # tier is due. Failures and the budget are the controller's: it counts them for the whole group.
        self.ledger = StepLedger("worker")
        self.step_time_s: float | None = None
        self.pace = Pace()  # its iterations and their time outside collectives, for the controller's straggler check
        self.loss: float | None = None  # of the newest committed step
        self.metrics: dict[str, float] = {}  # every scalar metric of the newest committed step
        self.ram: HostSnapshot | None = None  # the RAM replica: host copy of the newest committed step
        self.file_after_s = 0.0  # a step running this long gets the RAM replica's file (Form.file_after_s)
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
        self.owned: list[bool] = []  # per leaf: whether this process writes its shards there
        self.durable_lane = durable_lane(self)  # this process's part of each durable checkpoint, written in turn
        # Shapes and dtypes only: no process (a spare included) holds the whole state (runtime/core/initial.py).
        self.template: PyTree = abstract_state(self.job)
        self.batch_like: PyTree = batch_example(self.job.data)  # a global batch's shapes
        self.batch_rows = (0, 0)  # this process's rows of each global batch on the group's mesh
        self.batch_bytes = 0  # bytes read from the data source for the last step
        # Written into every replica, and required of any replica restored: another run's (or job's) files in
        # the same folder are never taken for ours.
        self.identity = run_identity(settings.run_id, self.template, steps) if settings.run_id else {}
        self.skipped: tuple[str, ...] = ()  # replica files the last read would not restore, for Joined
        self.fences: dict[int, int] = {}  # superseded generations' fences, from the newest Form
        self.mesh: Any = None
        self.compiled: Any = None
        self.spares = SpareStates()  # states the step may write its new one into (spares.py)
        self.state_shardings: Any = None
        self.batch_shardings: Any = None
        self.state: Any = None
        self.step_pool = StepThread()
        # The compiled step, snapshot and restore programs of every layout this process was in, kept to be
        # loaded, not traced, when a later group has the same layout (runtime/core/programs.py).
        self.programs = programs if programs is not None else ProgramStore(keep=False)
        self.form: Form | None = None  # of the current group
        # The group one slice smaller, its programs prepared while this one trains (smaller.py).
        self.smaller = SmallerGroup()
        self.deferred: Form | Stop | None = None  # a planned re-forming (or drain), due after its ``at_step``
        # A restore left running when the group re-formed: it may still be reading, and must not build arrays on
        # the next group's backend (see ``forming.form_group``).
        self.abandoned_restore: Future[Any] | None = None
        # Steps until a full garbage collection after leaving a group (runtime/cluster/worker/forming.py).
        self.collect_in: int | None = None
        self.durable_last = -1  # the step of the newest durable write started
        self.durable_committed = -1  # the newest durable step the controller committed (DurableCommitted)
        self.held = False  # told to stop stepping (``Stop.hold``): the run is draining
        self.stopped_by: Stop | None = None  # the Stop it exits on
        # Step threads left blocked in a dead peer's collective (stepping.py): while one is, this process can only
        # end with os._exit, so run() returns only once they have ended.
        self.abandoned: list[Future[Any]] = []
        self.mesh_history: list[dict[str, int]] = []  # the mesh of every generation it trained in
        self.result: RunResult | None = None  # once the group finished (training.finish)
        self.ended = threading.Event()  # the heartbeats stop
        self.script_settings = script_settings or {}  # what the script set of what the launch sets (Hello.settings)

    @property
    def step(self) -> int:
        return self.ledger.step

    def _durable_committed(self, step: int) -> None:  # the link's reader thread
        self.durable_committed = max(self.durable_committed, step)
        self.replicas.committed(step)

    # --- the loop ----------------------------------------------------------------------------------------

    def serve(self) -> int:
        """Handle controller messages until told to stop; returns the exit code."""
        events = self.script.events if self.script is not None else ()
        where = instance_name(self.settings)
        self.link.send(
            Hello(
                worker=self.worker,
                pid=os.getpid(),
                target_steps=self.target_steps,
                events=events,
                instance=where,
                settings=self.script_settings,
            )
        )
        leave_on_signal(self.link, self.worker, self.settings.grace_s)  # a node drain is a departure, not a loss
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        pending: Inbound | None = None
        while True:
            message = pending if pending is not None else self.link.inbox.get()
            pending = None
            match message:
                case Form() if self.initialized and message.generation <= self.generation:
                    # Joined already: a departure that died before its planned step makes the controller tell
                    # the members still stepping to join at once, and this one may have reached that step and
                    # joined in between. Joining the same coordination service twice ends the process.
                    log.info(
                        "worker %d: already in generation %d; its Form again ignored", self.worker, self.generation
                    )
                case Form():
                    form_group(self, message)
                case RestoreStep() if message.generation == self.generation:
                    # The restore is a collective too: if a peer dies during it, abandon it like a step. Its
                    # thread only returns what it restored; the worker's state is set here, by this thread.
                    abandoned = threading.Event()
                    future = self.step_pool.submit(restore_step, self, message, self.files, abandoned)
                    self.files = {}
                    outcome = await_step(self, future, what=f"the restore of step {message.step}")
                    if isinstance(outcome, Message):
                        abandoned.set()
                        self.abandoned_restore = future
                        pending = outcome
                    elif outcome is not None:
                        adopt_restored(self, message, outcome[0])
                        if self.form is not None:
                            self.smaller.start(self, self.form)
                        # Held here through training, the restored state and its host copy were two more
                        # copies of this process's shards for the whole run (docs/multiprocess.md, memory).
                        del outcome, future
                        pending = train(self, message.target_steps)
                case RestoreStep():
                    log.info("stale restore for generation %d ignored", message.generation)
                case Warm(programs=programs) if not self.initialized:
                    warm_up(self, programs)
                case Warm():
                    pass
                case Stop(hold=True):
                    log.info("worker %d holds at step %d: %s", self.worker, self.step, message.reason)
                    self.held = True
                    self.heartbeat()  # says the step it holds at
                case Stop(reason=reason, exit_code=code):
                    log.info("worker %d stops (exit code %d): %s", self.worker, code, reason)
                    self.stopped_by = message
                    self.smaller.stop()
                    if message.durable_step >= 0:
                        final_durable(self, message.durable_step)
                    return code

    def _beat(self) -> None:
        due = time.monotonic()
        while not self.ended.is_set():
            late = time.monotonic() - due
            if late > _LATE_BEAT_S:
                log.warning("worker %d: heartbeat %.2f s late (waited for the GIL or a CPU)", self.worker, late)
            self.heartbeat(memory=True)
            due = time.monotonic() + self.settings.heartbeat_s
            self.ended.wait(self.settings.heartbeat_s)

    def still_blocked(self, wait_s: float) -> bool:
        """Whether a step thread abandoned in a dead peer's collective is still blocked in XLA, after waiting up
        to ``wait_s`` for them all (they end when the old group's sockets close, or at the collective timeout)."""
        deadline = time.monotonic() + wait_s
        for future in self.abandoned:
            try:
                future.exception(timeout=max(deadline - time.monotonic(), 0.0))
            except FutureTimeout:
                return True
        return False

    def leave(self) -> None:
        """The run is over and the script goes on: no more heartbeats, the link closed, the group left (its
        coordination service goes when the controller ends), the group's backend dropped."""
        import jax.extend.backend

        self.ended.set()
        self.link.close()
        self.smaller.stop()
        self.state = self.compiled = self.ram = self.neighbour = None
        leave_group()
        jax.extend.backend.clear_backends()

    def heartbeat(self, *, memory: bool = False) -> None:
        """Tell the controller the step it holds. The memory report (read from ``/proc``) rides on the periodic
        beats only: the one sent with every committed step would repeat it on the step's critical path (the
        controller keeps the newest report it got)."""
        self.link.send(
            Heartbeat(
                worker=self.worker,
                generation=self.generation,
                step=self.step,
                step_time_s=self.step_time_s,
                iteration_s=self.pace.iteration_s,
                outside_s=self.pace.outside_s,
                loss=self.loss,
                metrics=self.metrics,
                sent_at=time.time(),
                held=self.held,
                memory=self._memory() if memory else {},
            )
        )

    def _memory(self) -> dict[str, int]:
        """Resident memory and host copies, for the heartbeat (read from the heartbeat's thread: a copy replaced
        meanwhile is counted as the one it replaced, the same size)."""
        ram, neighbour = self.ram, self.neighbour
        copies = {"ram": ram.nbytes if ram is not None else 0, "neighbour": neighbour.nbytes if neighbour else 0}
        return resident() | copies | {"batch": self.batch_bytes}

    def report_failure(self, failed: StepFailed, trace: str = "", *, unsupported: bool = False) -> None:
        """Tell the controller the run cannot go on (``failed``; ``unsupported``: the job is one this mode cannot
        run); it publishes the event and stops every worker (this one waits for its Stop)."""
        report = EventReport(
            worker=self.worker,
            generation=self.generation,
            event=failed,
            traceback=trace[-4000:],  # the end of a traceback names the failing line
            unsupported=unsupported,
        )
        self.link.send(report)

    def unsupported(self, message: str) -> None:
        """The job is one this mode cannot run: the controller ends the run with ``JobUnsupported``."""
        failed = StepFailed(step=self.step, source="worker", error_type="JobUnsupported", message=message)
        self.report_failure(failed, unsupported=True)
