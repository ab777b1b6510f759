"""What the controller's :class:`~elastic_runtime.cluster.controller.supervisor.Supervisor` is told (inputs) and what it
answers (actions): plain values, so that the supervisor's tests drive it without processes or sockets and the controller
carries the actions out in the order given; and the phases it goes through."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from elastic_runtime.cluster.config import LaunchError, Strategy
from elastic_runtime.cluster.controller.heartbeat import Watching
from elastic_runtime.cluster.protocol import Message
from elastic_runtime.cluster.tiers import Tier
from elastic_runtime.core.errors import ElasticRuntimeError
from elastic_runtime.core.events import Event

__all__ = [
    "GONE",
    "Action",
    "BackingOff",
    "Done",
    "DrainRequested",
    "EndRun",
    "FillSeats",
    "Finish",
    "Forming",
    "Idle",
    "Input",
    "Joining",
    "Kill",
    "LeaveRequested",
    "MemberFinished",
    "MemberJoined",
    "MemberRestored",
    "Phase",
    "Place",
    "Progress",
    "Publish",
    "Readmitted",
    "Recruiting",
    "RegroupRequested",
    "RestoreFailed",
    "RestoreTally",
    "SaveFences",
    "Send",
    "SendForm",
    "Settling",
    "Spawn",
    "Start",
    "Status",
    "Tick",
    "TopUpSpares",
    "WarmSpares",
    "Watch",
    "WorkerChanged",
    "WorkerFailed",
]


class Status(Enum):
    """Where a worker process stands in the run. The supervisor decides it (``Place``); a process's exit makes
    it ``LOST`` and a lost worker's return ``STOPPED`` in the pool's record, which the supervisor reads."""

    SPARE = "spare"  # started; waits to be seated (a survivor a smaller group has no seat for waits here too)
    MEMBER = "member"  # seated in the group
    LOST = "lost"  # judged lost, replaced, or exited: never seated again
    STOPPED = "stopped"  # told to stop (drained, left, or back after it was judged lost): its exit is expected


GONE = (Status.LOST, Status.STOPPED)  # never seated again


# --- inputs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """The run begins: form the first group."""


@dataclass(frozen=True)
class WorkerFailed:
    """The heartbeat monitor's verdict on ``worker``, taken once, straight from the monitor: ``cause`` is the
    event published for it (``WorkerLost``, ``WorkerHung``), ``message`` what was seen. The worker is killed (a
    hung or stopped one must not come back half-way through a re-forming), replaced, and the group re-forms."""

    worker: int
    cause: str
    message: str


@dataclass(frozen=True)
class RegroupRequested:
    """Replace ``workers`` and re-form the group (``ControllerContext.regroup``, a handler's request). Workers
    already being replaced (a verdict came first) are not counted again: ``strategy`` overrides the re-forming's."""

    workers: frozenset[int]
    reason: str
    strategy: Strategy | None = None


@dataclass(frozen=True)
class WorkerChanged:
    """A worker's record changed: a spare said hello, or a process exited or its connection closed."""

    worker: int


@dataclass(frozen=True)
class MemberJoined:
    """A member of the forming generation sent ``Joined`` (its record holds it)."""

    worker: int


@dataclass(frozen=True)
class RestoreFailed:
    """A member could not read the step being restored (its ``EventReport`` of a ``CheckpointCorrupt``)."""

    generation: int
    step: int
    reason: str
    recovered_from: Tier | None = None  # the tier it read the step from instead; None: it could not


@dataclass(frozen=True)
class Progress:
    """A member's heartbeat: its committed step, its recent step time, and the loss of that step."""

    worker: int
    step: int
    step_time_s: float | None = None
    loss: float | None = None  # of ``step``
    metrics: dict[str, float] = field(default_factory=dict)  # of ``step``


@dataclass(frozen=True)
class MemberRestored:
    """A member restored ``nbytes`` from ``tier`` in ``read_s``, then took part in the group's collective for
    ``transfer_s`` (``Restored``)."""

    tier: str
    nbytes: int
    read_s: float = 0.0
    transfer_s: float = 0.0


@dataclass
class RestoreTally:
    """What a generation's members restored: the bytes per tier, the slowest member's read per tier, and the
    slowest member's collective (the group's restore ends with its slowest member)."""

    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    read_s_by_tier: dict[str, float] = field(default_factory=dict)
    transfer_s: float = 0.0

    def add(self, member: MemberRestored) -> None:
        if member.nbytes:  # a member that took every shard from the others delivered nothing itself
            tier = member.tier
            self.bytes_by_tier[tier] = self.bytes_by_tier.get(tier, 0) + member.nbytes
            self.read_s_by_tier[tier] = max(self.read_s_by_tier.get(tier, 0.0), member.read_s)
        self.transfer_s = max(self.transfer_s, member.transfer_s)


@dataclass(frozen=True)
class MemberFinished:
    """A member reached the run's target (its record holds its ``Finished``)."""

    worker: int


@dataclass(frozen=True)
class DrainRequested:
    """Take the members on ``instance`` out of the group at a planned step, and seat no worker of it until
    :class:`Readmitted` (``ControllerContext.drain``): its host is about to go down for maintenance."""

    instance: str
    reason: str


@dataclass(frozen=True)
class LeaveRequested:
    """Worker ``worker`` asked to leave (``Leaving``: SIGTERM from its host): the group goes on without it from a
    planned step, like a drained host's members, and it is told to exit there (``forming.departure_code``); a
    spare is told at once."""

    worker: int
    reason: str


@dataclass(frozen=True)
class Readmitted:
    """Workers on ``instance`` may be seated again (its maintenance is over; ``ControllerContext.readmit``)."""

    instance: str


@dataclass(frozen=True)
class Tick:
    """Time passed: a deadline (:attr:`Supervisor.deadline`) may be due."""


Input = (
    Start
    | WorkerFailed
    | RegroupRequested
    | WorkerChanged
    | MemberJoined
    | RestoreFailed
    | MemberRestored
    | Progress
    | MemberFinished
    | Tick
    | DrainRequested
    | LeaveRequested
    | Readmitted
)


# --- actions -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spawn:
    """Start ``count`` spare processes now (they are needed for the group being formed)."""

    count: int


@dataclass(frozen=True)
class TopUpSpares:
    """Start spares until ``config.spares`` are alive."""


@dataclass(frozen=True)
class Watch:
    """Judge ``worker`` as ``how`` from now (``HeartbeatMonitor.watch``): the heartbeat monitor is switched by
    these, applied before the other actions of the same input, never by the supervisor itself."""

    worker: int
    how: Watching
    from_step: int | None = None


@dataclass(frozen=True)
class Place:
    """``worker`` now stands at ``status`` in the run (seated, back among the spares, lost, told to stop): the
    supervisor keeps its own record of where it put each worker, and the pool's record follows by this action,
    applied with the ``Watch`` actions before the others of the same input."""

    worker: int
    status: Status


@dataclass(frozen=True)
class Kill:
    """SIGKILL ``worker`` (logged as ``WorkerKilled``)."""

    worker: int
    reason: str


@dataclass(frozen=True)
class Send:
    """Send ``message`` to ``worker``."""

    worker: int
    message: Message


@dataclass(frozen=True)
class SendForm:
    """Host generation ``generation``'s coordination service and send each member its ``Form``; the shell
    reports the coordinator's address back with :meth:`Supervisor.hosted`. With ``seats``, send only those
    members' Forms, for the service already up."""

    generation: int
    members: tuple[int, ...]
    strategy: Strategy
    at_step: int  # a planned re-forming (growing) happens after this step; -1: now
    # Only these members' Forms: spares taking lost members' seats in this generation, whose service is up.
    seats: tuple[int, ...] = ()


@dataclass(frozen=True)
class FillSeats:
    """Fill the lost members' ``seats`` of generation ``generation``, given up before it formed, with stand-ins
    (``standin.py``): every member left it for a later one, and its start still waits for those seats."""

    generation: int
    coordinator: str
    seats: tuple[int, ...]


@dataclass(frozen=True)
class SaveFences:
    """Write the generation and fences to the run folder (a resumed controller goes on from them)."""


@dataclass(frozen=True)
class WarmSpares:
    """Idle spares compile the step now rather than when they are needed."""


@dataclass(frozen=True)
class Publish:
    event: Event


@dataclass(frozen=True)
class EndRun:
    """End the run with ``error``: every worker stopped."""

    error: ElasticRuntimeError | LaunchError


@dataclass(frozen=True)
class Finish:
    """Every member finished: the run ends well."""


Action = (
    Spawn
    | TopUpSpares
    | Watch
    | Place
    | Kill
    | Send
    | SendForm
    | FillSeats
    | SaveFences
    | WarmSpares
    | Publish
    | EndRun
    | Finish
)


# --- phases: where the supervisor is, what it waits for, and what it knows only there -----------------------


@dataclass(frozen=True)
class Idle:
    """Not started yet, or training (the generation got its ``RestoreStep``): waiting for nothing."""

    deadline: None = None


@dataclass(frozen=True)
class Settling:
    """A failure came: waiting until ``deadline`` for the ones that come with it, again while more may be found,
    up to ``until``."""

    deadline: float
    until: float


@dataclass(frozen=True)
class BackingOff:
    """A step failed before: forming again at ``deadline``, the retry policy's backoff, for ``reason``."""

    deadline: float
    reason: str


@dataclass(frozen=True)
class Forming:
    """The generation being formed: how (``strategy``), why, since when, who stays from the group before it, and
    who a drain takes out at its planned step."""

    strategy: Strategy
    reason: str
    started: float
    survivors: tuple[int, ...] = ()
    leaving: tuple[int, ...] = ()


@dataclass(frozen=True)
class Recruiting:
    """Waiting for enough spares to say hello (those ``chosen`` so far) until ``deadline``, ``timeout_s`` after
    the forming started."""

    forming: Forming
    deadline: float
    timeout_s: float
    chosen: tuple[int, ...] = ()


@dataclass(frozen=True)
class Joining:
    """``Form`` sent: waiting for every member's ``Joined`` until ``deadline``."""

    forming: Forming
    deadline: float


@dataclass(frozen=True)
class Done:
    """Finished, or ended."""

    deadline: None = None


Phase = Idle | Settling | BackingOff | Recruiting | Joining | Done
