"""Every event the runtime knows, as frozen msgspec Structs in one tagged family.

Facts are named in the past tense (``StepCompleted``), requests in the imperative (``SaveCheckpoint``).
Events carry plain data only: steps, times, device ids, paths. An exception travels as its type name and
message, never pickled. The JSON tag of an event is its class name, so a user-defined subclass of
:class:`Event` is encoded, logged and decoded like a built-in one once its module is imported.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec

__all__ = [
    "CheckpointBehind",
    "CheckpointCommitted",
    "CheckpointCorrupt",
    "CheckpointFailed",
    "CheckpointSkipped",
    "CheckpointStarted",
    "ConfigOverridden",
    "ConnectionRefused",
    "CorruptionHealed",
    "DataMismatch",
    "DeviceLost",
    "Drain",
    "Event",
    "Failure",
    "GroupFormed",
    "GroupForming",
    "HandlerFailed",
    "HostError",
    "LikelyMeshesReady",
    "MaintenanceCompleted",
    "MaintenanceScheduled",
    "MaintenanceStarted",
    "MalformedHeartbeat",
    "MalformedNotice",
    "MeshChanged",
    "MeshReady",
    "MeshReduced",
    "Notice",
    "NoticeIgnored",
    "NoticeSourceFailed",
    "NoticeSourceReady",
    "Preempted",
    "ProcessLost",
    "RecoveryCompleted",
    "RecoveryFailed",
    "RecoveryStarted",
    "ReplicaSkipped",
    "RunFinished",
    "RunStarted",
    "SaveCheckpoint",
    "ScaleUpAvailable",
    "SilentCorruption",
    "SliceLost",
    "StateRestored",
    "StateTransformed",
    "StepCompleted",
    "StepFailed",
    "Straggler",
    "WorkerExited",
    "WorkerHung",
    "WorkerKilled",
    "WorkerLost",
    "WorkerSignalled",
    "WorkerStarted",
    "event_types",
]


def _wall() -> float:
    return time.time()


def _mono() -> float:
    return time.monotonic()


class Event(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of all events: when it happened, at which step, and who said so."""

    wall_time: float = msgspec.field(default_factory=_wall)
    mono_time: float = msgspec.field(default_factory=_mono)
    step: int | None = None
    source: str = ""


# --- run progress -------------------------------------------------------------------------------------


class RunStarted(Event, frozen=True, kw_only=True):
    """The executor is about to run its first step."""

    target_steps: int
    mesh_shape: dict[str, int]
    devices: tuple[int, ...]


class RunFinished(Event, frozen=True, kw_only=True):
    """The run ended, normally (``ok``) or with an error that ``reason`` names. Under ``launch``, ``memory`` holds
    each worker's (by id) newest memory report: peak and current resident bytes and its host copies of the state
    (``elastic_runtime.cluster.protocol.Heartbeat.memory``)."""

    ok: bool
    reason: str = ""
    memory: dict[str, dict[str, int]] = {}


class StepCompleted(Event, frozen=True, kw_only=True):
    """Step ``step`` committed: its new state replaced the old one. ``step`` counts committed steps.

    ``duration_s`` is the step's computation; ``data_s`` the time spent loading its batch. ``snapshot`` says
    the RAM tier holds the state after this step; ``snapshot_wait_s`` is what that copy added to the step:
    the step's time over the running average of steps without a copy (0 when the copy is compiled into the
    step, as with a snapshot every step, or when there is no copy: on CPU devices the snapshot is the state
    itself), and ``duration_s`` is the step's time less it. ``metrics`` holds every scalar the step returned, by
    name (nested keys joined with ``/``); ``loss`` is the one the job's ``loss_key`` names.
    """

    duration_s: float
    loss: float | None = None
    metrics: dict[str, float] = {}
    mesh_shape: dict[str, int]
    data_position: int
    data_s: float = 0.0
    snapshot: bool = False
    snapshot_wait_s: float = 0.0


# --- failures -----------------------------------------------------------------------------------------


class Failure(Event, frozen=True, kw_only=True):
    """Base of every failure. ``error_type`` and ``message`` describe the underlying exception, if any."""

    error_type: str = ""
    message: str = ""


class StepFailed(Failure, frozen=True, kw_only=True):
    """The user's step raised an error that is not an infrastructure failure. The run stops."""


class DeviceLost(Failure, frozen=True, kw_only=True):
    """Devices of the mesh stopped answering (``status`` is the XLA status, e.g. DATA_LOSS)."""

    devices: tuple[int, ...]
    status: str = ""


class SliceLost(DeviceLost, frozen=True, kw_only=True):
    """Whole slices (groups of ``slice_size`` devices) were lost; ``slices`` names their indices."""

    slices: tuple[int, ...]
    slice_size: int


class ProcessLost(Failure, frozen=True, kw_only=True):
    """A peer process of a multi-controller group failed (JAX's ``ProcessFailureError``)."""

    processes: tuple[int, ...] = ()


class WorkerLost(Failure, frozen=True, kw_only=True):
    """``worker`` was killed or its host is gone: no heartbeat within the timeout, its connection or process
    ended, or the scheduler reported it dead. ``detected_by`` names the signal that came first (the only one
    acted on): ``"heartbeat"`` (the controller's own: silence, a closed connection, an exited process) or
    ``"ray"`` (Ray reported the worker's actor or node dead; ``runtime/cluster/controller/ray_backend.py``)."""

    worker: int
    silent_s: float
    detected_by: str = "heartbeat"


class WorkerHung(Failure, frozen=True, kw_only=True):
    """``worker`` still sends heartbeats but made no step progress within the timeout."""

    worker: int
    stalled_s: float


class SilentCorruption(Failure, frozen=True, kw_only=True):
    """Replicas of the state that must be bitwise equal differ after ``step`` (silent data corruption: a device
    that computed wrong, a flipped bit), found by the state's fingerprint (``RuntimeConfig.fingerprint_every``).
    ``suspects``: the devices that disagree with the majority of their ``replicas`` (``attributed``), or every
    replica of the block when no majority says which (two replicas); ``digests`` by device. ``persistent``: it
    came back when the step was replayed from the newest verified state (or the device was a suspect before):
    faulty hardware, evicted like a lost slice; else a transient flip, healed by the replay. Under ``launch``
    the slices are the replicas, and ``workers`` are those whose devices are suspects: a persistent one's are
    replaced, and the group re-forms."""

    suspects: tuple[int, ...]
    digests: dict[str, str]
    replicas: int
    attributed: bool
    persistent: bool = False
    workers: tuple[int, ...] = ()


class CorruptionHealed(Event, frozen=True, kw_only=True):
    """The state's replicas agree again at ``step`` after a ``SilentCorruption``: ``kind`` ``transient`` (the
    replay from the newest verified state agreed) or ``persistent`` (the ``evicted`` devices were taken out of the
    mesh), ``seconds`` after it was found."""

    kind: str
    suspects: tuple[int, ...]
    evicted: tuple[int, ...] = ()
    seconds: float


class Straggler(Event, frozen=True, kw_only=True):
    """The group would step ``slowdown`` times faster without ``worker``: it spends ``excess_s`` more per iteration
    outside the step's collectives than the group's median, and the others wait for it (``iteration_s``: the group's
    iteration with it). ``action``
    is the controller's choice, ``replace`` (at a planned step, by a ready spare: nothing lost) or ``keep``, and
    ``reason`` says why (what the slowdown costs over the remaining steps against what a re-forming costs)."""

    worker: int
    slowdown: float = 0.0  # defaults: an event log written before these fields (a step time then) still reads
    excess_s: float = 0.0
    iteration_s: float = 0.0
    action: str = "keep"
    reason: str = ""


class DataMismatch(Failure, frozen=True, kw_only=True):
    """The batch read at ``position`` after a restore differs from the one read there before: the data source
    is not deterministic, so the replayed steps train on other data (``check_data``; the run goes on)."""

    position: int
    expected_crc32c: str
    got_crc32c: str


class ConfigOverridden(Event, frozen=True, kw_only=True):
    """Under ``launch``, a setting the training script gave (``setting``, as ``value``) that does not apply there:
    ``flag`` says what sets it for the whole group (a flag of the launch) or why it has no effect, and the log says
    so."""

    setting: str
    value: str
    flag: str


class MeshReduced(Event, frozen=True, kw_only=True):
    """The run starts on ``mesh_shape``, smaller than the policy's ``target_shape``: too few healthy devices."""

    target_shape: dict[str, int]
    mesh_shape: dict[str, int]
    devices: tuple[int, ...]


class MalformedHeartbeat(Failure, frozen=True, kw_only=True):
    """A line on an authenticated connection to the controller's port did not decode, or named another worker.

    Rate-limited: the first such line from a host (``peer``) is reported at once, then one event each 10 s
    says how many more came (``count``) and the last one's ``reason``.
    """

    peer: str
    reason: str
    count: int = 1


class ConnectionRefused(Failure, frozen=True, kw_only=True):
    """The controller closed a connection to its port before accepting a message from it: no or a wrong proof
    of the run's secret, no proof within the handshake deadline, too many connections waiting to prove it, or
    a ``Hello`` for a worker id the controller did not start, already connected, or with another pid.

    Rate-limited like :class:`MalformedHeartbeat`: ``count`` connections from host ``peer``, the last one
    refused for ``reason``.
    """

    peer: str
    reason: str
    count: int = 1


class HandlerFailed(Failure, frozen=True, kw_only=True):
    """A handler raised, or ran past its timeout (``timed_out``), while handling ``event_type``."""

    handler: str
    event_type: str
    timed_out: bool = False


class CheckpointFailed(Failure, frozen=True, kw_only=True):
    """A save to ``tier`` failed; training goes on and older checkpoints stay intact."""

    tier: str
    reason: str


class CheckpointCorrupt(Failure, frozen=True, kw_only=True):
    """A checkpoint in ``tier`` failed verification at ``path``; restore falls back to the next one."""

    tier: str
    path: str
    reason: str


class MalformedNotice(Failure, frozen=True, kw_only=True):
    """A maintenance notice could not be parsed; it was acknowledged and dropped."""

    message_id: str = ""
    reason: str


class NoticeIgnored(Failure, frozen=True, kw_only=True):
    """A well-formed notice that concerns none of this run's hosts (another project's instance, or an instance
    none of the workers runs on); it changed nothing."""

    instance: str
    message_id: str = ""
    reason: str


class NoticeSourceFailed(Failure, frozen=True, kw_only=True):
    """The notice source ``source`` (``pubsub``, ``metadata``) cannot read ``address`` (the subscription, or the
    metadata server): ``reason`` says why (no credentials, the subscription does not exist, permission denied,
    unreachable). ``permanent``: an error that does not go away by itself (it needs an operator). Until a
    ``NoticeSourceReady`` the run has no maintenance protection from that source; the source tries again, at
    most ``retry_s`` apart."""

    address: str
    reason: str
    permanent: bool = False
    retry_s: float = 0.0


class NoticeSourceReady(Event, frozen=True, kw_only=True):
    """The notice source ``source`` (``pubsub``, ``metadata``) reads ``address`` (the subscription, or the
    metadata server): the run's maintenance notices come through it. Published when it first connects, and again
    once it recovered from a ``NoticeSourceFailed``."""

    address: str


# --- maintenance notices ------------------------------------------------------------------------------


class Notice(Event, frozen=True, kw_only=True):
    """Base of Google Cloud maintenance and preemption notices for one of this job's instances."""

    instance: str
    kind: str = ""
    message_id: str = ""


class MaintenanceScheduled(Notice, frozen=True, kw_only=True):
    """Maintenance of ``instance`` will start in the window [``window_start``, ``window_end``] (epoch s)."""

    window_start: float | None = None
    window_end: float | None = None
    can_reschedule: bool = False


class MaintenanceStarted(Notice, frozen=True, kw_only=True):
    """Maintenance of ``instance`` is under way."""


class MaintenanceCompleted(Notice, frozen=True, kw_only=True):
    """Maintenance of ``instance`` is over; it may be re-admitted."""


class Preempted(Notice, frozen=True, kw_only=True):
    """``instance`` is being preempted; what is not saved within the grace period is lost."""


class HostError(Notice, frozen=True, kw_only=True):
    """``instance``'s host failed and the VM was restarted."""


# --- checkpoints --------------------------------------------------------------------------------------


class CheckpointStarted(Event, frozen=True, kw_only=True):
    """A save of ``step`` to ``tier`` began."""

    tier: str


class CheckpointCommitted(Event, frozen=True, kw_only=True):
    """The checkpoint of ``step`` in ``tier`` is complete and verified; ``path`` locates it."""

    tier: str
    path: str
    bytes: int
    seconds: float


class CheckpointSkipped(Event, frozen=True, kw_only=True):
    """A save to ``tier`` was skipped (e.g. the previous one is still running); ``reason`` says why."""

    tier: str
    reason: str


class CheckpointBehind(Event, frozen=True, kw_only=True):
    """A save of ``step`` to ``tier`` came due while the tier was still writing step ``writing``: it waits and
    starts when that write ends (the tier's cadence stretches to its write time). ``behind_steps``: how far the
    tier's newest committed checkpoint is behind ``step`` (``step`` when it has none)."""

    tier: str
    writing: int
    behind_steps: int


class ReplicaSkipped(Event, frozen=True, kw_only=True):
    """A replica at ``path`` was not restored: ``reason`` says why (another run's or another job's files,
    or a step past the run's target). Published once per path."""

    path: str
    reason: str


# --- recovery -----------------------------------------------------------------------------------------


class RecoveryStarted(Event, frozen=True, kw_only=True):
    """The executor paused after ``cause`` and waits for handlers to re-mesh and restore."""

    cause: str
    last_committed_step: int


class MeshChanged(Event, frozen=True, kw_only=True):
    """The executor now runs on a new mesh. ``needs_restore``: the live state was lost with the old one."""

    old_shape: dict[str, int]
    new_shape: dict[str, int]
    devices: tuple[int, ...]
    reason: str
    needs_restore: bool
    seconds: float = 0.0  # resharding the live state (0 when it was lost)


class StateRestored(Event, frozen=True, kw_only=True):
    """The state of ``step`` was restored from ``restored_from`` onto the current mesh. ``reason``: why a run that
    had committed steps went back to the initial state (``restored_from`` ``init``): what was missing."""

    restored_from: str
    lost_steps: int
    seconds: float
    reason: str = ""


class StateTransformed(Event, frozen=True, kw_only=True):
    """A handler's state transform (``ctx.transform_state``) replaced the state of ``step``, for ``reason``."""

    reason: str
    seconds: float


class RecoveryCompleted(Event, frozen=True, kw_only=True):
    """The first step after a failure committed; ``recovery_s`` runs from the failure to this commit, of which
    ``compile_wait_s`` waited for the new mesh's programs (0 when they were compiled ahead).

    Under ``launch``, what the restore moved: ``bytes_by_tier`` the bytes the members read from each tier,
    ``read_s_by_tier`` the slowest member's read from each, ``transfer_s`` the slowest member's part in the
    collective that handed every member its shards (empty and 0 in one process, where the restore is in RAM).
    """

    cause: str
    failed_step: int
    recovery_s: float
    lost_steps: int
    restored_from: str
    mesh_shape: dict[str, int]
    compile_wait_s: float = 0.0
    bytes_by_tier: dict[str, int] = {}
    read_s_by_tier: dict[str, float] = {}
    transfer_s: float = 0.0


class MeshReady(Event, frozen=True, kw_only=True):
    """The programs a step on ``mesh_shape`` (``devices``) runs are compiled, ahead of need, in ``seconds``:
    a failure that leads to this mesh recovers without compiling. ``loaded`` of them were not compiled but loaded
    from the same programs compiled for another mesh of the shape (on CPU: ``elastic_runtime.core.same_shape``)."""

    mesh_shape: dict[str, int]
    devices: tuple[int, ...]
    seconds: float
    loaded: int = 0


class LikelyMeshesReady(Event, frozen=True, kw_only=True):
    """Every mesh a next failure on ``mesh_shape`` would lead to (``meshes`` of them, one lost slice each) is
    compiled, ``seconds`` after the mesh was taken into use: from now on no single failure waits for a compile.
    Under ``launch``, from each worker (``source`` worker-N) of a group that may go on one slice smaller: its
    programs of that layout are kept (``meshes`` 1; runtime/cluster/worker/smaller.py)."""

    mesh_shape: dict[str, int]
    meshes: int
    seconds: float


class RecoveryFailed(Failure, frozen=True, kw_only=True):
    """Recovery could not complete; the run stops with :class:`elastic_runtime.core.errors.RecoveryError`."""

    reason: str


class ScaleUpAvailable(Event, frozen=True, kw_only=True):
    """More healthy devices than the current mesh uses; the mesh policy can grow to ``shape``."""

    devices: tuple[int, ...]
    shape: dict[str, int]


# --- multi-process groups (logged by the controller) -------------------------------------------------


class WorkerStarted(Event, frozen=True, kw_only=True):
    """The controller started worker process ``worker`` (``pid``); ``spare``: kept warm, not yet a member."""

    worker: int
    pid: int
    spare: bool


class WorkerExited(Event, frozen=True, kw_only=True):
    """Worker ``worker``'s process ended with ``returncode`` (negative: killed by that signal)."""

    worker: int
    returncode: int


class WorkerSignalled(Event, frozen=True, kw_only=True):
    """Worker ``worker`` got ``signal`` (SIGTERM or SIGINT: a node drain, a preemption) and asked to leave: the
    group goes on without it from a planned step (a spare may take its seat), and its departure is no failure."""

    worker: int
    signal: str


class WorkerKilled(Event, frozen=True, kw_only=True):
    """The controller sent ``signal`` to worker ``worker`` (to remove a hung worker, or by fault injection)."""

    worker: int
    signal: str
    reason: str


class GroupForming(Event, frozen=True, kw_only=True):
    """Generation ``generation`` is forming: ``members`` (worker ids, by process id) were told to join it;
    ``reason`` says why (the start, a loss, a drain, a spare ready to grow the group) and what was chosen (going
    on smaller, and why)."""

    generation: int
    members: tuple[int, ...]
    strategy: str
    reason: str = ""


class GroupFormed(Event, frozen=True, kw_only=True):
    """Generation ``generation`` of the group formed: ``members`` (worker ids, by process id) joined it."""

    generation: int
    members: tuple[int, ...]
    coordinator: str
    strategy: str
    seconds: float
    restore_step: int
    restore_source: int
    # The slowest member's join, by phase (wait, leave, connect, trace, compile, load, read), in seconds; and how many
    # programs the members traced and compiled (0: every one was loaded, kept from an earlier generation).
    phases: dict[str, float] = {}
    traced: int = 0
    instances: tuple[str, ...] = ()  # where each member runs (its instance or host), as its Hello said


# --- requests -----------------------------------------------------------------------------------------


class SaveCheckpoint(Event, frozen=True, kw_only=True):
    """Ask the checkpointer to save the newest snapshot to ``tiers`` (empty: every durable tier) now."""

    tiers: tuple[str, ...] = ()
    reason: str = ""


class Drain(Event, frozen=True, kw_only=True):
    """Ask the runtime to move work off ``instance`` before ``deadline`` (epoch s)."""

    instance: str
    deadline: float | None = None
    reason: str = ""


def event_types() -> tuple[type[Event], ...]:
    """Every concrete event class known now, built-in and user-defined (imported) subclasses alike."""
    found: list[type[Event]] = []
    pending: list[type[Event]] = [Event]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return tuple(found)


# --- which mode publishes what ---------------------------------------------------------------------------

# Events one mode never gives a handler, each with what to subscribe to there instead. Embedded: nothing is a
# worker or a group. Under ``launch`` (the script's handlers in every worker, fed by the controller): the
# controller replaces whole processes, so a device is never lost alone, never returns alone, and is never drained.
_NEVER = {
    "embedded": {
        "WorkerLost": "a lost device or slice is DeviceLost / SliceLost in one process",
        "WorkerHung": "a hung step is a StepFailed in one process",
        "Straggler": "one process has no slower peer",
        "GroupForming": "one process forms no group",
        "GroupFormed": "one process forms no group; a new mesh is MeshChanged",
        "WorkerStarted": "one process starts no worker",
        "WorkerExited": "one process starts no worker",
        "WorkerSignalled": "one process starts no worker",
        "WorkerKilled": "one process starts no worker",
        "MalformedHeartbeat": "one process has no heartbeats",
        "ConnectionRefused": "one process takes no connection",
        "ReplicaSkipped": "one process has no replica files",
    },
    "launch": {
        "DeviceLost": "a worker's lost device is its WorkerLost (or WorkerHung)",
        "SliceLost": "a worker's lost device is its WorkerLost (or WorkerHung)",
        "ScaleUpAvailable": "a group grows back when a replacement joins: MeshChanged",
        "MeshReady": "a re-formed group loads the programs prepared ahead: GroupFormed",
        "MeshReduced": "the group starts on --nprocs workers: RunStarted",
        "Drain": "the controller drains a host's workers itself (docs/gcp-setup.md)",
    },
}


def never_published(mode: str, subscribed: Iterable[type[Event]]) -> list[str]:
    """Of the event types ``subscribed`` to, each one that ``mode`` (``embedded`` or ``launch``) never publishes,
    as ``Name (why; what instead)``: a handler for it would never run."""
    never = _NEVER[mode]
    names = sorted({kind.__name__ for kind in subscribed if kind.__name__ in never})
    return [f"{name} ({never[name]})" for name in names]
