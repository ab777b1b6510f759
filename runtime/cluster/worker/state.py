"""A worker process's state: what it holds of the group, the state and its replicas, the step it is at, and the
few things every part of its loop does with it (beat, report a failure, leave the group). The parts are functions
over it (``forming``, ``restore``, ``training``, ``stepping``, ``durable``, ``smaller``, ``handlers``), and
:class:`~elastic_runtime.cluster.worker.loop.Worker` is it with the message loop: all of them above it in the
import graph, none below.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from elastic_runtime.cluster.collectives import GroupMinimum, NeighbourShift, SliceRestore
from elastic_runtime.cluster.protocol import EventReport, Form, Heartbeat, Notify, Stop
from elastic_runtime.cluster.tiers import Tier
from elastic_runtime.cluster.worker.group import leave_group
from elastic_runtime.cluster.worker.link import ControllerLink
from elastic_runtime.cluster.worker.pace import Pace
from elastic_runtime.cluster.worker.settings import WorkerSettings
from elastic_runtime.cluster.worker.spares import SpareStates
from elastic_runtime.cluster.worker.thread import StepThread
from elastic_runtime.core.events import StepFailed
from elastic_runtime.core.executor import RunResult
from elastic_runtime.core.fingerprint import Integrity
from elastic_runtime.core.initial import abstract_state
from elastic_runtime.core.job import PyTree, TrainJob
from elastic_runtime.core.keys import with_key_data
from elastic_runtime.core.ledger import StepLedger
from elastic_runtime.core.memory import resident, return_freed_memory
from elastic_runtime.core.process_data import batch_example
from elastic_runtime.core.programs import ProgramStore
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.core.step_core import StepCore
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.lane import Lane
from elastic_runtime.storage.replicas import ReplicaFiles, run_identity
from elastic_runtime.storage.sharded import ShardedStore

__all__ = ["Script", "Smaller", "WorkerState"]

log = logging.getLogger(__name__)


class Script(Protocol):
    """The script's own handlers as the worker's parts use them (``handlers.ScriptHandlers``)."""

    events: tuple[str, ...]

    def received(self, notify: Notify) -> None: ...

    def boundary(self, worker: WorkerState) -> tuple[Any, float]: ...

    def finished(self, worker: WorkerState) -> None: ...


class Smaller(Protocol):
    """The preparation of the group one slice smaller (``smaller.SmallerGroup``)."""

    def start(self, worker: WorkerState, form: Form) -> None: ...

    def stop(self) -> None: ...


class WorkerState:
    """One worker process's state, and what every part of its loop does with it (beat, report a failure, leave).
    The parts take it as their argument; :class:`~elastic_runtime.cluster.worker.loop.Worker` adds the message loop,
    which builds the parts that run in threads of their own (the durable lane, the smaller group's preparation).

    Args:
        job: the training job.
        steps: the run's target.
        settings: this worker's environment.
        link: the connection to the controller.
        replicas: this process's replica files.
        script: the script's own handlers, or None.
        programs: compiled programs kept across groups (default: none kept).
        script_settings: what the script set of what the launch sets (``Hello.settings``).
        fingerprint: compare the slices' copies of the state after every step, before it commits (training.py).
    """

    durable_lane: Lane[Any]  # this process's part of each durable checkpoint, written in turn (durable.py)
    smaller: Smaller  # the group one slice smaller, its programs prepared while this one trains (smaller.py)

    def __init__(
        self,
        job: TrainJob,
        steps: int,
        *,
        settings: WorkerSettings,
        link: ControllerLink,
        replicas: ReplicaFiles,
        script: Script | None = None,
        programs: ProgramStore | None = None,
        script_settings: dict[str, str] | None = None,
        fingerprint: bool = False,
        gather: bool = False,
    ) -> None:
        # The job as it runs: typed PRNG keys in its state held as key data (elastic_runtime.core.keys).
        self.job, self.keys = with_key_data(job)
        if settings.return_freed_memory:
            return_freed_memory()
        # The training script's own handlers, run at step boundaries (runtime/cluster/worker/boundary.py).
        self.script = script
        if script is not None:
            link.on_notify = script.received
        self.target_steps = steps
        self.settings = settings
        self.worker = settings.worker
        self.link = link
        self.replicas = replicas
        link.on_committed = self._durable_committed
        self.fingerprint = fingerprint
        # The whole final state gathered into the lead for its run() (asked by the script, or by --result, which
        # writes it): every member takes part in the gather, so every member must ask alike (one script).
        self.gather = gather or bool(settings.result)
        self.integrity: Integrity | None = None  # the slices compared, in a group of two or more (forming.py)
        self.generation = 0
        self.layout: dict[str, str] = {}  # which shards this process holds, in every replica's metadata
        self.slice_size = 1  # processes per slice (storage/boxes.py)
        self.local_like: PyTree = None  # shapes of this process's shards (elastic_runtime.storage.boxes.local_like)
        self.process_id = -1
        self.num_processes = 0
        self.in_a_group = threading.Event()  # set once it first joined one (notices wait for it: boot.py)
        # The newest committed step held on the devices (or in ``ram``), its loss and metrics, and the step that
        # moves it on, as the single-process executor has them (core/step_core.py); its ledger says when the replica
        # file and the durable tier are due. Failures and the budget are the controller's: it counts them for the
        # whole group. Its step checks (one that raises or never returns stops the step there) and input faults
        # are where fault injection hooks in (elastic_runtime.faults.process).
        self.core = StepCore(self.job, self.keys, StepLedger("worker"))
        if settings.step_delay_s:  # a bigger model's step (tests, demos: room to kill a worker mid-run)
            delay = settings.step_delay_s
            self.core.step_checks.append(lambda _step, _devices: time.sleep(delay))
        self.pace = Pace()  # its iterations and their time outside collectives, for the controller's straggler check
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
        self.deferred: Form | Stop | None = None  # a planned re-forming (or drain), due after its ``at_step``
        # A restore left running when the group re-formed: it may still be reading, and must not build arrays on
        # the next group's backend (see ``forming.form_group``).
        self.abandoned_restore: Future[Any] | None = None
        # Steps until a full garbage collection after leaving a group (runtime/cluster/worker/forming.py).
        self.collect_in: int | None = None
        self.durable_last = -1  # the step of the newest durable write started
        # A durable step due and not written yet, the same in every member: (generation, step, whether the lead said
        # it waits). Written once every writer's previous write has ended, agreed at a boundary (durable.py).
        self.durable_due: tuple[int, int, bool] | None = None
        self._minimum: tuple[int, GroupMinimum] | None = None  # the group's agreement program, of that generation
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
        return self.core.step

    def _durable_committed(self, step: int) -> None:  # the link's reader thread
        self.durable_committed = max(self.durable_committed, step)
        self.replicas.committed(step)

    def group_minimum(self, value: int) -> int:
        """The smallest of ``value`` over the group's processes: a collective, called in the step thread at the
        same point of every member's loop (the handlers' boundary, the durable writers' agreement)."""
        if self._minimum is None or self._minimum[0] != self.generation:
            self._minimum = (self.generation, GroupMinimum())  # on the group's backend
        return self._minimum[1](value)

    # --- the loop ----------------------------------------------------------------------------------------

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
        self.core.state = self.compiled = self.ram = self.neighbour = None
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
                step_time_s=self.core.step_s,
                iteration_s=self.pace.iteration_s,
                outside_s=self.pace.outside_s,
                loss=self.core.loss,
                metrics=self.core.metrics,
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
