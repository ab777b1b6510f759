"""The supervisor's state: its phase (a frozen record of what it waits for and what it knows only there, the
generation being formed among it), where it put each worker, what it knows of the group, the drains and
departures, and the few steps every part of its decisions takes (count a failure, end the run, describe a
committed step). The decisions are functions over it (``forming.py``, ``formed.py``, ``planned.py``) and the
:class:`~elastic_runtime.cluster.controller.supervisor.Supervisor` itself, all above it in the import graph.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_runtime.cluster.config import LaunchConfig, LaunchError, Strategy
from elastic_runtime.cluster.controller.heartbeat import HeartbeatMonitor
from elastic_runtime.cluster.controller.membership import Membership
from elastic_runtime.cluster.controller.processes import ProcessPool, log_tail
from elastic_runtime.cluster.controller.supervision import (
    GONE,
    Action,
    Done,
    EndRun,
    Idle,
    Phase,
    Place,
    Publish,
    RestoreTally,
    Status,
    Watch,
)
from elastic_runtime.core.errors import ElasticRuntimeError, RecoveryError
from elastic_runtime.core.events import StepCompleted
from elastic_runtime.core.recovery import RecoveryTracker

__all__ = ["GivenUp", "SupervisorState"]


@dataclass
class GivenUp:
    """A generation given up before it formed: its service, the lost members' seats in it, and the members
    still waiting in its start (until their heartbeats name a later generation)."""

    coordinator: str
    seats: tuple[int, ...]
    waiting: set[int]


class SupervisorState:
    """What the supervisor knows and the steps every part of it takes (count a failure, end the run, publish a
    committed step): the state that ``forming.py``, ``formed.py`` and ``planned.py`` decide over, below them in
    the import graph; :class:`~elastic_runtime.cluster.controller.supervisor.Supervisor` adds the decisions.

    Args:
        config: the run's settings.
        pool: the workers' records, read only: the shell starts processes and fills in what it sees of them
            (tests add records); where a worker stands follows the supervisor's ``Place`` actions.
        group: the group's membership.
        monitor: the heartbeat monitor, read only (whether more losses may be on their way); its switches are
            ``Watch`` actions.
        recovery: the failure budget and recovery timing.
        target_steps: the run's target; -1 until the first worker's hello says it (see :attr:`target_steps`).
    """

    def __init__(
        self,
        config: LaunchConfig,
        pool: ProcessPool,
        group: Membership,
        monitor: HeartbeatMonitor,
        recovery: RecoveryTracker,
        *,
        target_steps: int = -1,
    ) -> None:
        self.config = config
        self.pool = pool
        self.group = group
        self.monitor = monitor
        self.recovery = recovery
        self.target_steps = target_steps
        self.now = 0.0  # monotonic seconds: the time of the input being decided (``Supervisor.handle``)
        self.phase: Phase = Idle()  # where it is, what it waits for, and what it knows only there
        self.places: dict[int, Status] = {}  # where this supervisor put each worker (none yet: where it started)
        self.stopped = False  # the run is ending: nothing is replaced or formed any more
        self.restored = False  # the current generation got its RestoreStep
        self.restore_tally = RestoreTally()  # what the current generation's members restored
        self.requests: dict[int, str] = {}  # members to replace at the next re-forming -> why
        self.strategy: Strategy | None = None  # a handler's strategy for the next re-forming (``RegroupRequested``)
        self.unreadable = ""  # the current generation's restore failed: why
        self.failed_restores: set[tuple[int, int]] = set()  # (generation, step) of each restore re-formed for
        self.reform_s = 0.0  # the newest formation's seconds (the first's, compile included, until a re-forming)
        self.slowest_join = 0.0  # the longest a member of a formed group took to join (its compile included)
        self.group_shape: dict[str, int] = {}  # the mesh of the newest generation formed (MeshChanged)
        self.survivor_restarts = 0  # survivors the restart strategy replaced, in all (LaunchResult's)
        self.coordinator = ""  # the current generation's coordination service ("" before it is hosted)
        # Members of the generation being formed (``Joining``) not joined yet: kept beside the phase, not in its
        # frozen record, so that a join costs O(1) however large the group.
        self.unjoined: set[int] = set()
        self.growable: bool | None = None  # whether a ready spare would grow the group; None: look again
        # Instances (hosts) under maintenance: their workers are taken out of the group and not seated again
        # until re-admitted (``DrainRequested``, ``Readmitted``).
        self.cordoned: set[str] = set()
        self.drains: dict[str, str] = {}  # instance -> why, drains not yet started
        self.departures: dict[int, str] = {}  # member -> why: members that asked to leave (``LeaveRequested``)
        # Members drained or let go at a planned step -> (the generation formed without them, that step). Until
        # then they step with the old group, whose collectives need them: an earlier end is a loss.
        self.departing: dict[int, tuple[int, int]] = {}
        self.given_up: dict[int, GivenUp] = {}  # generation -> what stays to do for it (``forming.give_up``)

    @property
    def done(self) -> bool:
        return isinstance(self.phase, Done)

    @property
    def deadline(self) -> float | None:
        """When to be handed a ``Tick``: the phase's deadline, if it has one."""
        return self.phase.deadline

    def status(self, worker: int) -> Status:
        """Where ``worker`` stands: where this supervisor put it, unless the shell has seen it go since (its
        process exited, or it came back after it was judged lost and was told to exit)."""
        seen = self.pool[worker].status
        return seen if seen in GONE else self.places.get(worker, seen)

    def gone(self, worker: int) -> bool:
        """Lost or told to stop: it holds no seat and is never seated again."""
        return self.status(worker) in GONE

    def spare(self, worker: int) -> bool:
        return self.status(worker) is Status.SPARE

    def place(self, out: list[Action], worker: int, status: Status) -> None:
        """Put ``worker`` at ``status`` (the pool's record follows by the ``Place`` action). One told to stop stays
        so when lost: its exit is still expected."""
        if status is Status.LOST and self.status(worker) is Status.STOPPED:
            return
        self.places[worker] = status
        out.append(Place(worker, status))

    def hosted(self, generation: int, coordinator: str) -> None:
        """The shell started generation ``generation``'s coordination service at ``coordinator``."""
        if generation == self.group.generation:
            self.coordinator = coordinator

    def mesh_shape(self) -> dict[str, int]:
        """The group's mesh: as its first member laid it out (the job's own axes), else the default layout."""
        first = self.pool[self.group.members[0]].joined if self.group.members else None
        if first is not None and first.mesh_shape:
            return dict(first.mesh_shape)
        size = self.config.slice_size
        return {"data": len(self.group.members) // size, "model": size * self.config.local_devices}

    def count_failure(self, out: list[Action], cause: str) -> None:
        step = self.group.step
        out.append(Publish(self.recovery.fail(cause, failed_step=step + 1, last_committed_step=step)))

    def spent(self, out: list[Action], last: str, lost: set[int]) -> bool:
        """Whether the failures counted so far spend the budget (then the run ends). The one check, made where
        failures are counted: one while a group forms ends the run as surely as any."""
        if not self.recovery.over_budget:
            return False
        error = RecoveryError(
            f"{self.recovery.failures} failures exceed max_failures={self.config.max_failures} "
            f"(the last: {last}){self.why(lost)}",
            last_committed_step=self.group.step,
        )
        self.end(out, error)
        return True

    def end(self, out: list[Action], error: ElasticRuntimeError | LaunchError) -> None:
        self.stopped = True
        self.phase = Done()
        out.append(EndRun(error))

    def why(self, lost: set[int]) -> str:
        """What the lost workers' logs say (their tracebacks): the reason a step keeps failing is in there."""
        logs = [self.pool.logs / f"worker-{w}.log" for w in sorted(lost)]
        return "".join(f"\nworker log {path}:\n{log_tail(path)}" for path in logs)

    def quiet(self, out: list[Action], workers: list[int]) -> None:
        """The group is not training: a worker that commits nothing now is not hung."""
        out.extend(Watch(worker, "idle") for worker in workers)

    def completed(
        self, step: int, seconds: float, loss: float | None = None, metrics: dict[str, float] | None = None
    ) -> StepCompleted:
        return StepCompleted(
            step=step,
            source="controller",
            duration_s=seconds,
            loss=loss,
            metrics=metrics or {},
            mesh_shape=self.mesh_shape(),
            data_position=step,
        )
