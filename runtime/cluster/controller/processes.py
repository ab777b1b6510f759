"""The worker processes the controller starts, signals and reaps, and what it knows of each."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from elastic_runtime.cluster import leftovers
from elastic_runtime.cluster.auth import ENV_TOKEN
from elastic_runtime.cluster.config import LaunchConfig
from elastic_runtime.cluster.controller.connection import Connection
from elastic_runtime.cluster.controller.exits import ExitWatch
from elastic_runtime.cluster.controller.forkserver import ForkedProcess, ForkServer, forkable
from elastic_runtime.cluster.controller.supervision import GONE, Status
from elastic_runtime.cluster.protocol import (
    ENV_COMPILE_CACHE,
    ENV_CONTROLLER,
    ENV_HEARTBEAT_S,
    ENV_LOCAL_DEVICES,
    ENV_REPLICA_DIR,
    ENV_RESULT,
    ENV_RUN_ID,
    ENV_WORKER,
    Finished,
    Hello,
    Joined,
)
from elastic_runtime.compat.xla import ENV_COLLECTIVE_TIMEOUT
from elastic_runtime.core.folders import COMPILE_CACHE_FOLDER

__all__ = ["ProcessPool", "WorkerProcess", "descends_from", "is_stopped", "log_tail", "parent_of", "state_of"]


@dataclass
class WorkerProcess:
    """One worker process and its connection: a spare until it is seated in a group.

    ``popen`` is None for a worker the controller did not start (``elastic-runtime controller``): it may run
    on another host, so nothing about it is read from ``/proc``; only its heartbeats say it is alive.
    """

    worker: int
    popen: subprocess.Popen[bytes] | ForkedProcess | None
    status: Status = Status.SPARE
    stream: Connection | None = None  # its connection, once its Hello was taken
    hello: Hello | None = None
    joined: Joined | None = None
    finished: Finished | None = None
    memory: dict[str, int] = field(default_factory=dict)  # its newest memory report (Heartbeat.memory)
    step: int = 0
    generation: int = 0
    # What the controller saw of its messages, connection and exit (not where it stands: ``status``).
    warmed: bool = False  # was sent Warm
    closed: bool = False  # its connection ended
    exit_seen: bool = False  # its exit was reported (``newly_exited``)
    held: int = -1  # the step it stopped stepping at when the run drains (``Stop.hold``); -1: not held

    @property
    def spare(self) -> bool:
        return self.status is Status.SPARE

    @property
    def gone(self) -> bool:
        """Lost or told to stop: it holds no seat and is never seated again."""
        return self.status in GONE

    @property
    def told_to_stop(self) -> bool:
        return self.status is Status.STOPPED

    def place(self, status: Status) -> None:
        """Where it stands now: as the supervisor placed it (``Place``), or lost once its exit is seen. Seated in
        a new group, what it joined or finished before is of the old one; one told to stop stays so when lost
        (its exit is still expected)."""
        if status is Status.LOST and self.status is Status.STOPPED:
            return
        if status is Status.MEMBER:
            self.joined = self.finished = None
        self.status = status

    @property
    def pid(self) -> int:
        """The process id: the one started, else the one its Hello gave (-1 before it)."""
        if self.popen is not None:
            return self.popen.pid
        return self.hello.pid if self.hello is not None else -1

    def exit_code(self) -> int | None:
        """The started process's exit code; None while it runs, and always for a worker not started here."""
        return self.popen.poll() if self.popen is not None else None

    def running(self) -> bool:
        """Started here and not exited, or (not started here) connected."""
        if self.popen is not None:
            return self.popen.poll() is None
        return self.stream is not None and not self.closed and not self.gone  # a lost one may never close

    def stopped(self) -> bool:
        """Started here and stopped (SIGSTOP); a worker not started here may be on another host: never."""
        return self.popen is not None and self.popen.poll() is None and is_stopped(self.popen.pid)

    def runs_here(self) -> bool:
        """Started here, running and not stopped: its silence is lateness (a loaded machine), not a loss."""
        return self.popen is not None and self.popen.poll() is None and not is_stopped(self.popen.pid)

    @property
    def connected(self) -> bool:
        """It said hello and its connection is open: seated now, it can be told to join at once."""
        return self.hello is not None and not self.closed

    @property
    def ready_spare(self) -> bool:
        """A spare that said hello and can be seated at once."""
        return self.spare and self.connected


def state_of(pid: int) -> str | None:
    """``pid``'s one-letter state in ``/proc`` (``R``, ``S``, ``T`` stopped, ``Z`` ...); None when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP): alive, silent, and making no progress."""
    return state_of(pid) in ("T", "t")


def parent_of(pid: int) -> int | None:
    """The pid of ``pid``'s parent; None when ``pid`` is gone."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the name (the state first, then the parent), None when ``pid`` is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()  # the name before ")" may hold spaces


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or a descendant of it (a worker command may be a wrapper, ``sh -c ...``)."""
    for _ in range(64):  # a process tree deeper than this is no worker's
        if pid == ancestor:
            return True
        parent = parent_of(pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


def log_tail(path: Path, limit: int = 3000) -> str:
    """The end of a worker's log that says why it failed: from its last traceback on, else its last lines."""
    try:
        text = path.read_bytes()[-64 * 1024 :].decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    start = text.rfind("Traceback (most recent call last)")
    # Without a traceback (a C++ abort), enough lines to show the generation it was in.
    tail = text[start:] if start >= 0 else "\n".join(text.strip().splitlines()[-20:])
    return tail.strip()[-limit:]


def dying_with_controller(command: list[str]) -> list[str]:
    """``command`` wrapped so that it is killed when the controller dies (``deathsig.py`` beside this module)."""
    if sys.platform != "linux":
        return command
    return [sys.executable, "-S", str(Path(__file__).with_name("deathsig.py")), str(os.getpid()), *command]


class ProcessPool:
    """Starts worker processes with the worker environment, one log file each, and tracks them by id.

    Args:
        config: the run's settings (command, devices per worker, heartbeat interval, extra environment).
        logs: the folder of the workers' log files.
        replica_dir: the workers' replica folder.
        secret: what the workers prove to the controller; handed over in their environment, which only their
            user can read (``/proc/PID/environ``), unlike the command line.
        run_id: the run's id, which the workers write into (and require of) every replica.
        run_dir: the run folder, named as the owner of the default replica folder (``leftovers.claim``): a later
            worker removes that folder once the run finished, never before (``--resume`` reads it).
    """

    def __init__(
        self,
        config: LaunchConfig,
        logs: Path,
        replica_dir: str,
        secret: str,
        run_id: str = "",
        run_dir: Path | None = None,
    ) -> None:
        self.config = config
        self.secret = secret
        self.logs = logs
        self.replica_dir = replica_dir
        self.run_id = run_id
        self.controller_address = ""  # host:port, set once the controller listens
        self.procs: dict[int, WorkerProcess] = {}
        self._next_worker = 0
        self.run_dir = run_dir
        self.forks: ForkServer | None = None
        self.exits = ExitWatch()  # wakes the reaper (workers.reap) when a process started here exits

    def __getitem__(self, worker: int) -> WorkerProcess:
        return self.procs[worker]

    def __iter__(self) -> Iterator[WorkerProcess]:
        return iter(list(self.procs.values()))

    def get(self, worker: int) -> WorkerProcess | None:
        return self.procs.get(worker)

    def runs_here(self, worker: int) -> bool:
        """Whether ``worker`` was started here and still runs (:meth:`WorkerProcess.runs_here`)."""
        proc = self.procs.get(worker)
        return proc is not None and proc.runs_here()

    def admit(self, worker: int) -> WorkerProcess:
        """Track a worker the controller did not start (it said hello on its own), as a spare."""
        proc = WorkerProcess(worker=worker, popen=None)
        self.procs[worker] = proc
        return proc

    def start_fork_server(self) -> None:
        """Start the server that forks later workers (``forkserver.py``), if the command allows it. Once it has
        imported JAX, :meth:`spawn` forks from it; until then, and if it fails, workers start as new processes."""
        command = list(self.config.command)
        if self.config.fork_spares and sys.platform == "linux" and forkable(command) and self.forks is None:
            shared = {k: v for k, v in self._env(-1).items() if k not in (ENV_WORKER, ENV_TOKEN)}
            log_path = self.logs / "forkserver.log"
            self.forks = ForkServer(command, shared, log_path, dying_with_controller, on_exit=self.exits.notify)

    def _env(self, worker: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.config.extra_env)
        env.update(
            {
                ENV_CONTROLLER: self.controller_address,
                ENV_WORKER: str(worker),
                ENV_REPLICA_DIR: self.replica_dir,
                ENV_RUN_ID: self.run_id,
                ENV_LOCAL_DEVICES: str(self.config.local_devices),
                ENV_HEARTBEAT_S: str(self.config.heartbeat_interval_s),
                ENV_COMPILE_CACHE: str(Path(self.replica_dir) / COMPILE_CACHE_FOLDER),
                ENV_TOKEN: self.secret,
            }
        )
        if self.config.result_path:
            env[ENV_RESULT] = self.config.result_path
        env.setdefault(ENV_COLLECTIVE_TIMEOUT, str(self.config.collective_timeout_s))  # the user's own wins
        return env

    def spawn(self) -> WorkerProcess:
        """Start a new worker process (a spare until seated): forked when the fork server is ready."""
        worker = self._next_worker
        self._next_worker += 1
        if self.run_dir is not None and self.config.replica_dir is None:
            leftovers.claim(self.replica_dir, run_dir=str(self.run_dir))
        env, log_path = self._env(worker), self.logs / f"worker-{worker}.log"
        command = list(self.config.command)
        popen: subprocess.Popen[bytes] | ForkedProcess | None = None
        if self.forks is not None:
            popen = self.forks.spawn(command, env, log_path)
        if popen is None:
            with open(log_path, "wb") as logfile:  # the child has its own copy of the descriptor
                popen = subprocess.Popen(
                    dying_with_controller(command),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=logfile,
                    stderr=subprocess.STDOUT,
                    # A group of its own: a terminal's Ctrl-C goes to the controller, which stops the workers. Not
                    # a session of its own: Linux's autogroups share the CPU out by session, and a worker alone in
                    # one stepped about 1.25x slower on 2 busy cores (docs/benchmarks.md).
                    process_group=0,
                )
            self.exits.watch(popen.pid)
        proc = WorkerProcess(worker=worker, popen=popen)
        self.procs[worker] = proc
        return proc

    def signal(self, worker: int, sig: str) -> bool:
        """Send ``SIG<sig>`` to ``worker``; False when it has already exited."""
        proc = self.procs.get(worker)
        if proc is None or proc.popen is None or proc.popen.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, getattr(signal, f"SIG{sig}"))
        return True

    def newly_exited(self) -> list[tuple[WorkerProcess, int]]:
        """Processes that exited since the last call, with their return codes; each is then marked gone."""
        exited = []
        for proc in self:
            if proc.exit_seen:
                continue
            code = proc.exit_code()
            # One told to go (drained, or it asked to leave) is gone already, but how it exited is still news.
            if code is not None and (not proc.gone or proc.told_to_stop):
                proc.place(Status.LOST)
                proc.exit_seen = True
                exited.append((proc, code))
        return exited

    def spares_missing(self) -> int:
        """How many spares to start to keep ``config.spares`` alive."""
        alive = [p for p in self if p.spare and p.running()]
        return self.config.spares - len(alive)

    def running(self) -> bool:
        return any(p.running() for p in self)

    def kill_all(self) -> None:
        """SIGKILL every process still running and wait for it. SIGTERM alone does not stop a JAX process
        once jax.distributed is up (its preemption notifier takes the signal)."""
        for proc in self:
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()
        if self.forks is not None:
            self.forks.close()
            self.forks = None
