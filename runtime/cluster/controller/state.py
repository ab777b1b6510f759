"""The controller's state: its run folder and record, the workers' pool, the group, the heartbeat monitor, the
supervisor, the run's result, and the requests every part of the controller makes of it (feed the supervisor an
input, publish, kill a worker, end the run). The parts are functions over it (``actions``, ``admission``,
``commits``, ``drain``, ``ending``, ``messages``, ``workers``; ``context`` and ``relay`` wrap it), and
:class:`~elastic_runtime.cluster.controller.shell.Controller` is it run: all of them above it in the import graph.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import secrets
import subprocess
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from elastic_runtime.cluster import auth
from elastic_runtime.cluster.config import LaunchConfig, LaunchError, LaunchResult, Strategy
from elastic_runtime.cluster.controller.heartbeat import HeartbeatMonitor
from elastic_runtime.cluster.controller.membership import Membership
from elastic_runtime.cluster.controller.outcome import Outcome
from elastic_runtime.cluster.controller.processes import ProcessPool
from elastic_runtime.cluster.controller.runfolder import default_replica_dir, open_run
from elastic_runtime.cluster.controller.server import WorkerServer
from elastic_runtime.cluster.controller.supervision import (
    DrainRequested,
    Input,
    LeaveRequested,
    Readmitted,
    RegroupRequested,
)
from elastic_runtime.cluster.controller.supervisor import Supervisor
from elastic_runtime.cluster.protocol import Published, Requested
from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.errors import BusClosed, ElasticRuntimeError
from elastic_runtime.core.eventlog import EventLog
from elastic_runtime.core.events import Event, SilentCorruption, WorkerKilled
from elastic_runtime.core.folders import PROGRAMS_PREFIX
from elastic_runtime.core.recovery import RecoveryTracker

if TYPE_CHECKING:
    from elastic_runtime.cluster.controller.durable import DurableCommits

__all__ = ["Changes", "ControllerState", "Relay", "is_loopback"]

log = logging.getLogger(__name__)


class Relay(Protocol):
    """The relay of the group's events to the script's handlers, as the message handlers use it (``relay.py``)."""

    async def requested(self, message: Requested) -> None: ...

    async def published(self, message: Published) -> None: ...


class Changes:
    """Wakes the controller's waits on its own records (a member holding, a durable commit ending) when one
    changes, instead of each wait reading them again every few milliseconds."""

    def __init__(self) -> None:
        self._changed = anyio.Event()

    def tell(self) -> None:
        self._changed.set()  # wakes every wait on it; the next waits take a new one
        self._changed = anyio.Event()

    async def until(self, ready: Callable[[], bool], deadline: float = math.inf) -> bool:
        """Whether ``ready()`` came true before ``deadline`` (``time.monotonic()``)."""
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with anyio.move_on_after(left):
                await self._changed.wait()
        return True


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


class ControllerState:
    """What the controller knows and holds (its run folder, the workers' pool, the group, the monitor, the
    supervisor, the result), and the requests every part makes of it (feed the supervisor, publish, kill, end).
    The parts take it as their argument; :class:`~elastic_runtime.cluster.controller.shell.Controller` adds the
    context, bus, relay and server (built from the parts) and runs it.

    Raises:
        LaunchError: asked to listen on an address other hosts can reach, or to coordinate workers it does
            not start, without a secret from the user (``config.secret``).
    """

    bus: EventBus  # the run's events (the shell builds it, with the handlers' context)
    relay: Relay  # the group's events to the script's handlers, and their requests back (relay.py)
    server: WorkerServer  # the workers' connections (server.py)

    def __init__(self, config: LaunchConfig) -> None:
        if config.secret is None and not is_loopback(config.listen_host):
            raise LaunchError(
                f"refusing to listen on {config.listen_host} without a secret: anyone who reaches it could steer "
                f"the run; set {auth.ENV_TOKEN} or {auth.ENV_TOKEN_FILE} (the same secret on every worker)"
            )
        if config.secret is None and not config.starts_workers:
            raise LaunchError(
                f"workers this controller does not start must prove a secret they know: set {auth.ENV_TOKEN} "
                f"or {auth.ENV_TOKEN_FILE} for the controller and every worker"
            )
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="elastic-launch-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "workers").mkdir(exist_ok=True)
        self.record = open_run(self.run_dir, resume=config.resume)
        self.replica_dir = config.replica_dir or default_replica_dir(self.run_dir)
        # This controller's folder of the workers' compiled programs (Form.programs): a new one each time, so a
        # resumed run (the script maybe edited) never loads an earlier controller's.
        self.programs = f"{PROGRAMS_PREFIX}{secrets.token_hex(8)}"
        self.event_log = EventLog(self.run_dir / "events.jsonl")
        # Never logged, never on a command line: the workers get it in their environment.
        self.secret = config.secret or auth.new_secret()
        self.pool = ProcessPool(
            config,
            self.run_dir / "workers",
            self.replica_dir,
            self.secret,
            run_id=self.record.run_id,
            run_dir=self.run_dir,
        )
        # A worker started here is lost when its process exits or its connection closes; its silence alone says
        # only that the machine is loaded, until the hang timeout (the heartbeat's docstring).
        self.monitor = HeartbeatMonitor(
            timeout_s=config.heartbeat_timeout_s,
            start_timeout_s=config.heartbeat_start_timeout_s,
            hang_timeout_s=config.hang_timeout_s,
            alive=self.pool.runs_here,
        )
        # A resumed run's generations go on from its record, its fences with them (see Membership.fences).
        self.group = Membership(
            config.nprocs, config.slice_size, generation=self.record.generation, fences=self.record.fences
        )
        self.recovery = RecoveryTracker("controller", config.max_failures)
        self.result = LaunchResult(
            ok=False,
            step=0,
            target_steps=-1,
            digests={},
            world_size_history=[],
            strategies=[],
            recoveries=[],
            detected_after_s=[],
            survivor_restarts=0,
            events_path=str(self.event_log.path),
            run_dir=str(self.run_dir),
            run_id=self.record.run_id,
        )
        # The controller's target, never a worker's to change: fixed by the config, else by the first worker's
        # Hello (see ``target_steps``).
        target = config.target_steps if config.target_steps is not None else -1
        self.supervisor = Supervisor(config, self.pool, self.group, self.monitor, self.recovery, target_steps=target)
        self.outcome = Outcome(self.result)  # the result's figures from the run's events (subscribed by the shell)
        # The supervisor's inputs, from the message handlers, the monitor's verdicts and the reaper, in order.
        self.inputs_in, self.inputs = anyio.create_memory_object_stream[Input](max_buffer_size=math.inf)
        self.port = 0
        # The durable checkpoints' store, opened by ``run`` once the fork server is starting (``open_durable``).
        self.durable: DurableCommits | None = None
        # Durable steps whose every part is in, committed one after another by ``commits.commit_durable``: a commit
        # (manifest, then pruning, seconds in GCS) awaited where messages are read would hold back the writer's
        # heartbeats, and the monitor would take a healthy worker for lost.
        self.to_commit: MemoryObjectSendStream[int] | None = None  # made (and closed) by ``run``
        self.commits_pending = 0
        self.durable_newest = -1  # the newest durable step this controller committed
        self.changes = Changes()  # told when a commit ends and when a member says it holds (drain.py)
        self.kill_times: dict[int, float] = {}  # worker -> when it was signalled, to time the detection
        # Every generation's coordination service stays up until the run ends: stopping one while a live
        # worker's client is still attached makes that client terminate its process.
        self.services: list[Any] = []
        self.standins: list[subprocess.Popen[bytes]] = []  # filling given-up generations' seats (``standin.py``)
        self.dead_before_hello = 0  # workers in a row that exited before their Hello: reset by any Hello
        self.settings_checked = False  # the script's own settings (Hello.settings), taken from the first Hello
        # Ending the run early: an error that ends it (a worker's StepError, JobUnsupported) or a signal
        # (SIGTERM, SIGINT) cancels the supervision, and the run drains like any other end.
        self.supervision: anyio.CancelScope | None = None  # made in the event loop, by run_async
        self._error: ElasticRuntimeError | LaunchError | None = None
        self.signalled = ""
        self.signalled_at = 0.0
        self.skipped_seen: set[str] = set()
        self.evicting: list[SilentCorruption] = []  # persistent corruptions whose workers go: healed once re-formed
        # Tasks run beside the wire and the monitor, and cancelled with them before the bus closes: a scheduler
        # backend's placement and watch loop (``runtime/cluster/controller/ray_backend.py``).
        self.companions: list[Callable[[], Coroutine[Any, Any, None]]] = []

    def waiting_for(self) -> str:
        """What the first group waits for, in words (the console says it while a real model starts)."""
        procs = [p for p in self.pool if not p.gone]
        connected = sum(p.hello is not None for p in procs)
        joined = sum(p.joined is not None for p in procs)
        n = self.config.nprocs
        if joined:
            return f"{joined} of {n} workers joined the first group; the others are joining (connecting, compiling)"
        if connected >= n:  # the spares count: the group forms from the first n to be ready
            return f"{connected} workers connected for a group of {n}; forming it"
        return (
            f"{connected} of {n} workers connected; the others are starting (importing the script and JAX, and "
            "the script's own code before it calls run())"
        )

    @property
    def members(self) -> list[int]:
        """Worker ids of the current group, in process-id order."""
        return self.group.members

    @property
    def group_step(self) -> int:
        """The newest step the whole group committed."""
        return self.group.step

    @property
    def stopping(self) -> bool:
        """The run is ending: nothing is replaced any more."""
        return self.supervisor.stopped

    @property
    def target_steps(self) -> int:
        """The run's target step; -1 until the first of the controller's own workers says hello."""
        return self.supervisor.target_steps

    @target_steps.setter
    def target_steps(self, steps: int) -> None:
        self.supervisor.target_steps = steps

    def mark_lost(self, worker: int, reason: str, *, detected_by: str) -> bool:
        """A scheduler says ``worker`` is gone (Ray: its actor or node died). It becomes a ``WorkerLost`` with
        ``detected_by`` at the monitor's next check, unless another signal was first (then nothing happens).
        False when the worker is not watched (it never said hello, or it was already judged lost)."""
        if worker not in self.monitor.workers:
            return False
        self.monitor.mark_gone(worker, reason, detected_by=detected_by)
        return True

    def open_durable(self) -> DurableCommits | None:
        """The store of ``--durable``'s checkpoints, None without one. Its storage modules import JAX, which
        the controller needs for nothing else: opened after the fork server's start, the two imports overlap."""
        config, location = self.config, self.config.durable_dir
        if not location:
            return None
        from elastic_runtime.cluster.controller.durable import DurableCommits  # imports JAX: not before the fork server

        metadata = {"run_id": self.record.run_id}
        return DurableCommits(location, writers=config.slice_size, keep=config.durable_keep, metadata=metadata)

    def end(self, error: ElasticRuntimeError | LaunchError) -> None:
        """End the run with ``error`` (the first one wins): every worker is stopped, the run fails with it."""
        if self._error is None:
            self._error = error
        self.supervisor.stopped = True
        if self.supervision is not None:
            self.supervision.cancel()

    def feed(self, event: Input) -> None:
        """Hand the supervisor an input; it takes them one at a time, in order (``actions.supervise``)."""
        try:
            self.inputs_in.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):  # the run is over
            log.debug("after the run, dropped %s", type(event).__name__)

    # --- processes -----------------------------------------------------------------------------------------

    def publish_nowait(self, event: Event) -> None:
        """Publish ``event`` from synchronous code; dropped once the bus is closed."""
        try:
            self.bus.publish_nowait(event)
        except BusClosed:  # the run is over; nothing reads events any more
            log.debug("after the bus closed, dropped %s", type(event).__name__)

    def kill(self, worker: int, sig: str, reason: str) -> None:
        """Send ``SIG<sig>`` to ``worker``'s process and log it as ``WorkerKilled`` (nothing if it has exited)."""
        if self.pool.signal(worker, sig):
            self.kill_times[worker] = time.monotonic()
            self.publish_nowait(
                WorkerKilled(step=self.group_step, source="controller", worker=worker, signal=sig, reason=reason)
            )

    # --- requests from handlers -----------------------------------------------------------------------------

    def request_drain(self, instance: str, reason: str) -> None:
        """Take ``instance``'s workers out of the group at a planned step; seat none of it until readmitted."""
        if not self.stopping:
            self.feed(DrainRequested(instance, reason))

    def readmit(self, instance: str) -> None:
        """Workers on ``instance`` may be seated again."""
        self.feed(Readmitted(instance))

    def request_leave(self, worker: int, reason: str) -> None:
        """Take member ``worker`` out at a planned step, as if it had asked to leave (``Leaving``)."""
        if not self.stopping:
            self.feed(LeaveRequested(worker, reason))

    def request_regroup(self, lost: set[int], reason: str, strategy: Strategy | None) -> None:
        """Replace ``lost`` workers and re-form the group; each lost member counts against the budget."""
        if not self.stopping:
            self.feed(RegroupRequested(frozenset(lost), reason, strategy))
