"""The controller-worker protocol: small tagged msgspec messages, one JSON object a line, over loopback TCP.

Workers say who they are (:class:`Hello`), report progress (:class:`Heartbeat`), say which step they can
restore (:class:`Joined`), that they are done (:class:`Finished`) or that they were asked to leave
(:class:`Leaving`), and send the core events only they see as those events themselves (:class:`EventReport`:
the user's code failed, a checkpoint did not verify). The controller tells them which group to form
(:class:`Form`), which step to restore from whom (:class:`RestoreStep`) and when to stop (:class:`Stop`).
The union is declared once and one decoder per direction is reused. Anything that does not decode is
reported as :class:`MalformedMessage` by the reader, never raised into the controller's loop.
"""

from __future__ import annotations

from typing import Union

import msgspec

from elastic_runtime.cluster.tiers import Tier
from elastic_runtime.core.events import (
    CheckpointBehind,
    CheckpointCorrupt,
    CorruptionHealed,
    LikelyMeshesReady,
    SilentCorruption,
    StepFailed,
)
from elastic_runtime.storage.manifest import FileEntry, LeafEntry

__all__ = [
    "ENV_COMPILE_CACHE",
    "ENV_CONNECT_S",
    "ENV_CONTROLLER",
    "ENV_GRACE_S",
    "ENV_HEARTBEAT_S",
    "ENV_INSTANCE",
    "ENV_JAX_HEARTBEAT_S",
    "ENV_JAX_INIT_S",
    "ENV_JAX_SHUTDOWN_S",
    "ENV_KEEP_PROGRAMS",
    "ENV_LOCAL_DEVICES",
    "ENV_METADATA_HOST",
    "ENV_PREPARE_SMALLER",
    "ENV_REPLICA_DIR",
    "ENV_RESULT",
    "ENV_RETURN_FREED_MEMORY",
    "ENV_RUN_ID",
    "ENV_SPARE_STATES",
    "ENV_STEP_DELAY_S",
    "ENV_WORKER",
    "EXIT_REPLACE",
    "ControllerMessage",
    "DurableCommitted",
    "EventReport",
    "Finished",
    "Form",
    "Heartbeat",
    "Hello",
    "Joined",
    "Lease",
    "Leaving",
    "MalformedMessage",
    "Noticed",
    "Notify",
    "Published",
    "Requested",
    "RestoreStep",
    "Restored",
    "Saved",
    "Stop",
    "Warm",
    "WorkerMessage",
    "decode_from_controller",
    "decode_from_worker",
    "encode",
]

# Environment the controller sets for each worker process.
ENV_CONTROLLER = "ELASTIC_CONTROLLER"  # host:port of the controller
ENV_WORKER = "ELASTIC_WORKER_ID"  # this process's worker id (unique for the run, never reused)
ENV_REPLICA_DIR = "ELASTIC_REPLICA_DIR"  # where replica files live (default under /dev/shm)
ENV_LOCAL_DEVICES = "ELASTIC_LOCAL_DEVICES"  # CPU devices per process
ENV_RESULT = "ELASTIC_RESULT"  # a folder where process 0 commits the final state (disk tier format), if set
ENV_RUN_ID = "ELASTIC_RUN_ID"  # the run's id: written into every replica, and only its replicas are restored
ENV_HEARTBEAT_S = "ELASTIC_HEARTBEAT_S"
ENV_INSTANCE = "ELASTIC_INSTANCE"  # the instance (host) this worker runs on, as maintenance notices name it
ENV_METADATA_HOST = "ELASTIC_METADATA_HOST"  # a metadata server to ask for the instance name (host:port)
ENV_JAX_HEARTBEAT_S = "ELASTIC_JAX_HEARTBEAT_S"
ENV_JAX_SHUTDOWN_S = "ELASTIC_JAX_SHUTDOWN_S"
ENV_JAX_INIT_S = "ELASTIC_JAX_INIT_S"
ENV_COMPILE_CACHE = "ELASTIC_COMPILE_CACHE"  # persistent XLA cache directory shared by the workers
ENV_CONNECT_S = "ELASTIC_CONNECT_TIMEOUT_S"  # how long a worker tries to reach the controller (default 120)
ENV_STEP_DELAY_S = "ELASTIC_STEP_DELAY_S"  # extra sleep per step (tests: room to kill mid-run)
# How long a worker told to go (SIGTERM, SIGINT) waits for the controller's Stop before it exits on its own.
ENV_GRACE_S = "ELASTIC_GRACE_S"
# "0": trace and compile every program again at each re-forming (runtime/core/programs.py; for comparisons)
ENV_KEEP_PROGRAMS = "ELASTIC_KEEP_PROGRAMS"
# "0": do not prepare the group one slice smaller while training (runtime/cluster/worker/smaller.py; for comparisons)
ENV_PREPARE_SMALLER = "ELASTIC_PREPARE_SMALLER"
# "0": leave glibc's malloc as it is (runtime/core/memory.py): faster steps on CPU devices, more resident memory
ENV_RETURN_FREED_MEMORY = "ELASTIC_RETURN_FREED_MEMORY"
# "0": every step's new state in fresh memory, not in a replaced one's (runtime/cluster/worker/spares.py)
ENV_SPARE_STATES = "ELASTIC_SPARE_STATES"

# The exit code of a worker that stops before the run is over: its place was taken (judged lost, or every worker
# replaced by the restart strategy), its controller is gone, or it left as it asked (SIGTERM) and the cluster is
# to start another in its place. A cluster scheduler (a Kubernetes Job, the SLURM script in examples/) starts a
# replacement with a new id on a non-zero code and counts a 0 as done.
# 75 is EX_TEMPFAIL in sysexits.h: a temporary failure, try again.
EXIT_REPLACE = 75

MAX_LINE = 1 << 20  # a heartbeat is ~150 bytes; anything near this is garbage or an attack


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of every wire message; the JSON tag is the class name."""


# --- worker -> controller ---------------------------------------------------------------------------------


class Hello(Message, frozen=True, kw_only=True):
    """First message on a connection: the worker id the controller gave this process, and its pid."""

    worker: int
    pid: int
    target_steps: int
    # The event types (class names) the script's own handlers subscribe to: the controller forwards those of
    # the group's events to this worker (``Notify``; runtime/cluster/controller/relay.py).
    events: tuple[str, ...] = ()
    # Where it runs: its GCE instance or TPU VM worker, its node (runtime/cluster/worker/instance.py); maintenance
    # notices name hosts by it. "": unknown.
    instance: str = ""
    # The script's own settings of what the launch sets for the whole group (its run folder, its durable tier's
    # cadence, its mesh): setting -> value. The controller applies or refuses each (controller/admission.py).
    settings: dict[str, str] = {}


class Heartbeat(Message, frozen=True, kw_only=True):
    """Alive, with the newest committed ``step`` of ``generation`` and how long the last step took."""

    worker: int
    generation: int
    step: int
    step_time_s: float | None = None
    # Its newest iteration, and of it the seconds outside the step's collectives (worker/pace.py): stragglers.
    iteration_s: float | None = None
    outside_s: float | None = None
    loss: float | None = None  # the loss of ``step`` (the job's ``loss_key`` in its metrics), where it has one
    metrics: dict[str, float] = {}  # every scalar metric of ``step`` (elastic_runtime.core.metrics)
    sent_at: float  # the worker's wall clock; the controller times silence with its own monotonic clock
    held: bool = False  # it stopped stepping when told (``Stop.hold``): ``step`` is its last
    # Bytes: the process's resident memory (``peak_rss``, ``rss``) and its host copies of the state (``ram``: its
    # own shards of the newest step, ``neighbour``: its neighbour's) and the bytes it read from the data source for
    # its last step (``batch``: its rows only, with a ProcessBatches source); runtime/core/memory.py.
    memory: dict[str, int] = {}


class Joined(Message, frozen=True, kw_only=True):
    """The worker joined group ``generation``; it can restore ``best_step`` from its own ``tier``."""

    worker: int
    generation: int
    best_step: int
    tier: Tier  # RAM (own memory), SHM or DISK (its newest replica file), DURABLE, or NONE
    # Every step it can restore (its RAM's and its replica files'): a slice whose processes' newest steps differ
    # restores an older step they all hold.
    steps: tuple[int, ...] = ()
    durable_only: tuple[int, ...] = ()  # of ``steps``, those only the durable tier has (its shards read from there)
    neighbour_step: int = 0  # the step of the neighbour replica it holds in RAM (cluster/collectives.py); 0: none
    join_s: float  # shutdown + re-initialize of jax.distributed, as the worker measured it
    skipped: tuple[str, ...] = ()  # replica files it would not restore, each "PATH: why" (another run's)
    # Where the join's time went, in seconds: wait (from the Form's arrival to the join's start), leave, connect,
    # trace, compile, load (compiled programs kept from an earlier generation, runtime/core/programs.py), read
    # (listing what it can restore).
    phases: dict[str, float] = {}
    traced: tuple[str, ...] = ()  # the programs it traced and compiled (none: every one was loaded)
    mesh_shape: dict[str, int] = {}  # the group's mesh, as the job's ProcessMesh laid it out


class Saved(Message, frozen=True, kw_only=True):
    """The worker wrote its part of step ``step``'s durable checkpoint (``storage/sharded.py``): ``files``,
    relative to the step's folder. The first process also sends the state's ``structure``, ``leaves`` and
    ``metadata``."""

    worker: int
    generation: int
    step: int
    data_position: int
    files: tuple[FileEntry, ...]
    structure: str = ""
    leaves: tuple[LeafEntry, ...] = ()
    metadata: dict[str, str] = {}  # the run's identity, as every replica carries it


class Restored(Message, frozen=True, kw_only=True):
    """The worker restored step ``step`` of ``generation``: ``nbytes`` of its shards came from its ``tier``
    ("ram", "shm", "disk", "durable", "neighbour": the next process's neighbour replica; "none": it held nothing
    and took every shard from its peers). ``read_s``: its read of them from that tier; ``transfer_s``: its part
    in the group's collective that moved every member's shards from the source slice."""

    worker: int
    generation: int
    step: int
    tier: Tier
    nbytes: int
    read_s: float = 0.0
    transfer_s: float = 0.0


class Finished(Message, frozen=True, kw_only=True):
    """The worker committed the target ``step``; ``digest`` is its final state's ``state_digest`` (8 hex digits), taken
    where the shards live: the same in every member of the group that ends the run."""

    worker: int
    generation: int
    step: int
    digest: str


class EventReport(Message, frozen=True, kw_only=True):
    """A core event only this worker saw in its part of generation ``generation``, built where it happened, for
    the controller to act on and publish (with its own clock's times and ``source`` "worker-N"):

    - :class:`~elastic_runtime.core.events.StepFailed`: the user's code failed in this worker (its data or step raised),
      or the job is one this mode cannot run (``unsupported``: the controller ends the run with
      ``JobUnsupported``). Not a lost worker: the run ends, nothing is retried. ``traceback``: the end of the
      error's traceback, for the run's ``StepError``.
    - :class:`~elastic_runtime.core.events.CheckpointCorrupt`: the worker could not read its shards of the step being
      restored from ``event.tier`` ("durable", or its replica files' "shm" or "disk"; ``event.path``: a missing,
      truncated or damaged file). ``recovered_from``: the tier it read the step from instead; None: none did, and
      the group must restore another step.
    - :class:`~elastic_runtime.core.events.LikelyMeshesReady`: this worker's programs of the group one slice smaller are
      kept (``runtime/cluster/worker/smaller.py``): a re-form without a lost slice loads them.
    - :class:`~elastic_runtime.core.events.CheckpointBehind`: a durable step came due while the lead's previous write
      still ran (``runtime/cluster/worker/durable.py``); ``event.tier`` is "durable".
    - :class:`~elastic_runtime.core.events.SilentCorruption`: the slices' copies of the state differ after
      ``event.step`` (the lead's report; every member found the same). ``processes``: those holding the suspect
      devices. Persistent: the controller replaces their workers and re-forms.
    - :class:`~elastic_runtime.core.events.CorruptionHealed`: the replay of the step agreed (a transient flip).

    An event of another type or without its step, a tier that is not one of
    :class:`~elastic_runtime.cluster.tiers.Tier`'s names, or a field of the envelope set for the other event does not
    decode.
    """

    worker: int
    generation: int
    event: StepFailed | CheckpointCorrupt | LikelyMeshesReady | CheckpointBehind | SilentCorruption | CorruptionHealed
    traceback: str = ""  # StepFailed only
    unsupported: bool = False  # StepFailed only
    recovered_from: Tier | None = None  # CheckpointCorrupt only
    processes: tuple[int, ...] = ()  # SilentCorruption only: the group's processes that hold its suspects

    def __post_init__(self) -> None:
        # On decoding, a ValueError here is msgspec's ValidationError, and so a MalformedMessage.
        if self.event.step is None:
            raise ValueError("event.step: a worker's event names the step it is about")
        if isinstance(self.event, CheckpointCorrupt):
            if self.event.tier not in Tier.__members__.values():
                raise ValueError(f"event.tier: {self.event.tier!r} is not a tier ({', '.join(Tier)})")
            if self.traceback or self.unsupported:
                raise ValueError("traceback and unsupported belong to a StepFailed, not to a CheckpointCorrupt")
        elif self.recovered_from is not None:
            raise ValueError("recovered_from belongs to a CheckpointCorrupt only")
        if not isinstance(self.event, StepFailed) and (self.traceback or self.unsupported):
            raise ValueError("traceback and unsupported belong to a StepFailed only")
        if isinstance(self.event, SilentCorruption) != bool(self.processes):
            raise ValueError("processes: a SilentCorruption names the processes of its suspects, nothing else does")
        if isinstance(self.event, CheckpointBehind) and self.event.tier != Tier.DURABLE:
            raise ValueError(f"event.tier: a worker's writes are behind in the durable tier, not {self.event.tier!r}")


class Requested(Message, frozen=True, kw_only=True):
    """A handler of the script asked for something only the controller can do: ``kind`` "abort" (the run ends
    with RecoveryError(``reason``)). Every process sends it for notification ``seq``; the controller acts once."""

    worker: int
    seq: int
    kind: str
    reason: str = ""


class Published(Message, frozen=True, kw_only=True):
    """An event the lead process's handlers published (``ctx.publish``) or one they caused (``HandlerFailed``),
    for the controller's bus and event log; ``event`` is the event's JSON (``elastic_runtime.core.eventlog``)."""

    worker: int
    event: msgspec.Raw


class Noticed(Message, frozen=True, kw_only=True):
    """A maintenance or preemption notice about this worker's own host, from the host's metadata server
    (``ELASTIC_METADATA_HOST``); ``event`` is the notice's JSON (``elastic_runtime.core.eventlog``). The controller
    takes it only about the instance the worker's ``Hello`` named."""

    worker: int
    event: msgspec.Raw


class Leaving(Message, frozen=True, kw_only=True):
    """The worker got ``signal`` (SIGTERM or SIGINT: a node drain, a preemption, ``scancel``) and will exit within
    its grace period: the group should go on without it at a planned step (``Stop.at_step``), a departure that is
    no failure. Until that Stop it keeps stepping with the group."""

    worker: int
    signal: str


# --- controller -> worker ---------------------------------------------------------------------------------


class Form(Message, frozen=True, kw_only=True):
    """Leave any current group and join ``generation``: ``jax.distributed`` at ``coordinator``, as ``process_id``."""

    generation: int
    coordinator: str
    process_id: int
    num_processes: int
    read_files: bool = True  # look in the replica files when this process holds no state in memory
    faults: str = ""  # this worker's faults, e.g. "die-midstep:1@12" (elastic_runtime.faults.grammar)
    at_step: int = -1  # re-form after committing this step (a planned change); -1: now (after a failure)
    run_id: str = ""  # the run's id, for a worker not started with it in its environment (ELASTIC_RUN_ID)
    slice_size: int = 1  # processes per slice: the state is sharded over the processes of a slice (storage/boxes.py)
    durable_dir: str = ""  # where the group's durable checkpoints go (storage/sharded.py); "": none
    durable_every: int = 0  # steps between durable checkpoints
    # Steps between replica files where every process holds the whole state (LaunchConfig.replica_file_every).
    file_every: int = 1
    # A step still running after this many seconds gets the step before it written to the replica file, if the
    # cadence skipped it: the controller may judge every member hung and replace them all (0: never).
    file_after_s: float = 0.0
    # keep the previous process's shards in RAM too (elastic_runtime.cluster.collectives.NeighbourShift)
    neighbour_replicas: bool = False
    # Superseded generations' fences: generation -> the step the group went on from. A replica a generation
    # wrote past its fence (a cut-off worker's, say) is never restored (storage/replicas.py).
    fences: dict[int, int] = {}
    # The folder (a name, in the run's replica folder) where this controller's workers keep their compiled
    # programs for each other (runtime/core/programs.py); new for every controller, so never another run's.
    programs: str = ""
    # The fewest processes the group may go on with (launch's --min-nprocs): where a group one slice smaller may
    # form, its members prepare its programs while they train (runtime/cluster/worker/smaller.py).
    min_processes: int = 0  # 0: not said (nothing is prepared)


class RestoreStep(Message, frozen=True, kw_only=True):
    """Restore ``step`` in ``generation`` from slice ``source`` (-1: the initial state); with one process per
    slice, a slice's index is its process id."""

    generation: int
    step: int
    source: int
    target_steps: int
    # Positions in the source slice whose processes take their shards from the next process's neighbour replica.
    from_neighbour: tuple[int, ...] = ()


class Warm(Message, frozen=True, kw_only=True):
    """A spare with nothing to do: compile the step once on a local backend, so that joining later is quick."""

    # The run's kept programs (Form.programs): where they are on the spare's host already, joining will load
    # them, and a warm-up that compiled the step for minutes would only keep the spare deaf to a Form.
    programs: str = ""


class Stop(Message, frozen=True, kw_only=True):
    """Exit now with ``exit_code``; ``reason`` is logged. The code is 0 when the run is over, or when the worker
    leaves as it asked (:class:`Leaving`) and the controller starts its own spares; :data:`EXIT_REPLACE` when the
    run goes on without this worker and a cluster scheduler is to start another in its place."""

    reason: str
    exit_code: int = 0
    # The run folder says the run finished: nothing will restore this worker's replica files (it removes them).
    finished: bool = False
    # Not an exit yet: stop stepping, say the last committed step (``Heartbeat.held``), wait for the next Stop.
    hold: bool = False
    # The first slice writes its part of a durable checkpoint of this step (its last, or the one before, from
    # its replica file) before exiting; -1: none.
    durable_step: int = -1
    at_step: int = -1  # stop after committing this step (a planned drain: the group re-forms there); -1: now


class DurableCommitted(Message, frozen=True, kw_only=True):
    """The group's durable checkpoint of ``step`` is committed: a worker's replicas pinned for older durable
    steps may go (``ReplicaFiles.committed``)."""

    step: int


class Lease(Message, frozen=True, kw_only=True):
    """The controller still counts on this worker for ``seconds`` from when it arrives; renewed every heartbeat
    interval (service mode). A worker whose lease runs out (cut off from the controller, which will re-form
    without it) stops stepping and writing replicas until it hears from the controller again."""

    seconds: float


class Notify(Message, frozen=True, kw_only=True):
    """One of the group's events, for the script's handlers in every member of ``generation``; ``seq`` numbers
    the controller's notifications (the group runs those every member holds at one step boundary).
    ``event`` is the event's JSON (``elastic_runtime.core.eventlog``), decoded by the worker with its own event
    types."""

    seq: int
    generation: int
    event: msgspec.Raw


WorkerMessage = Union[  # noqa: UP007 - msgspec needs a Union object
    Hello, Heartbeat, Joined, Saved, Restored, EventReport, Finished, Requested, Published, Noticed, Leaving
]
ControllerMessage = Union[Form, RestoreStep, Warm, Stop, Lease, DurableCommitted, Notify]  # noqa: UP007


class MalformedMessage(ValueError):
    """A line from a peer did not decode as a message of the expected direction."""


_encoder = msgspec.json.Encoder()
_from_worker = msgspec.json.Decoder(WorkerMessage)
_from_controller = msgspec.json.Decoder(ControllerMessage)


def encode(message: Message) -> bytes:
    """One message as a JSON line (newline included)."""
    return _encoder.encode(message) + b"\n"


def decode_from_worker(line: bytes) -> WorkerMessage:
    """Decode one line a worker sent. Raises MalformedMessage naming what was wrong."""
    try:
        message: WorkerMessage = _from_worker.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedMessage(f"{exc} in {line[:120]!r}") from exc
    return message


def decode_from_controller(line: bytes) -> ControllerMessage:
    """Decode one line the controller sent. Raises MalformedMessage naming what was wrong."""
    try:
        message: ControllerMessage = _from_controller.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise MalformedMessage(f"{exc} in {line[:120]!r}") from exc
    return message
