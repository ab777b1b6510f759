"""The multi-process controller: ``elastic-runtime launch --nprocs N -- python train.py ...``.

The controller starts N worker processes (plus warm spares), hands them a ``jax.distributed`` group on a
free loopback port, watches their heartbeats and, when one is lost or hangs, replaces it and re-forms the
group. It is never restarted because a worker failed: it is the one process that knows the run's history.

Recovery (see ``docs/multiprocess.md``) is a chain of events on the controller's bus: ``WorkerLost`` or
``WorkerHung`` -> the regroup handler (``handlers/regroup.py``) asks for a new group -> ``RecoveryStarted``
-> ``GroupFormed`` -> ``StateRestored`` -> ``RecoveryCompleted`` at the first step the new group commits.
Strategies: ``reform`` (survivors re-initialize ``jax.distributed`` in-process and a spare joins, taking
the state from its peers) and ``restart`` (every worker process replaced, state from the replica files in
``/dev/shm``), the fallback when a re-forming group does not come together in time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from runtime.bus import EventBus
from runtime.errors import BusClosed
from runtime.eventlog import EventLog
from runtime.events import (
    Event,
    RecoveryCompleted,
    RecoveryStarted,
    RunFinished,
    RunStarted,
    StateRestored,
    StepCompleted,
    Straggler,
    WorkerHung,
    WorkerLost,
)
from runtime.group_events import GroupFormed, MalformedHeartbeat, WorkerExited, WorkerKilled, WorkerStarted
from runtime.heartbeat import HeartbeatMonitor, Lost, UnknownWorker, Verdict, verdict_event, watch
from runtime.wire import (
    ENV_COMPILE_CACHE,
    ENV_CONTROLLER,
    ENV_HEARTBEAT_S,
    ENV_LOCAL_DEVICES,
    ENV_REPLICA_DIR,
    ENV_RESULT,
    ENV_WORKER,
    MAX_LINE,
    Finished,
    Form,
    Heartbeat,
    Hello,
    Joined,
    MalformedMessage,
    Message,
    Restore,
    Stop,
    Warm,
    decode_from_worker,
    encode,
)

log = logging.getLogger(__name__)

STRATEGIES = ("reform", "restart")


class LaunchError(RuntimeError):
    """The run could not go on: too few workers, too many failures, or a group that never formed."""


@dataclass(frozen=True)
class Kill:
    """Fault injection: send ``signal`` to the member with ``process_id`` once the group commits ``step``."""

    step: int
    process_id: int
    signal: str = "KILL"

    @classmethod
    def parse(cls, text: str) -> Kill:
        parts = text.split(":")
        try:
            step, pid = int(parts[0]), int(parts[1]) if len(parts) > 1 else 1
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--kill {text!r}: want STEP[:PROCESS_ID[:SIGNAL]]") from exc
        sig = parts[2].upper() if len(parts) > 2 else "KILL"
        if not hasattr(signal, f"SIG{sig}"):
            raise argparse.ArgumentTypeError(f"--kill {text!r}: unknown signal {sig}")
        return cls(step, pid, sig)


@dataclass
class LaunchConfig:
    """Settings of one multi-process run.

    Attributes:
        command: the worker command line (``python train.py ...``).
        nprocs: the group's full size.
        min_nprocs: the smallest group training may go on with while replacements start.
        spares: warm spare processes kept ready to replace a lost worker at once.
        local_devices: CPU devices per worker process.
        heartbeat_interval_s, heartbeat_timeout_s, hang_timeout_s: see :class:`HeartbeatMonitor`.
        strategy: "reform" (in-process re-forming, falling back to "restart") or "restart" always.
        form_timeout_s: how long a new group may take to form before its stragglers are replaced.
        spawn_timeout_s: how long a re-forming waits for replacements before going on with ``min_nprocs``.
        start_timeout_s: how long the first group may take to start.
        max_failures: failures the run survives.
        run_dir: event log, worker logs and ``summary.json``; a temporary directory when unset.
        replica_dir: the workers' replica files; default ``/dev/shm/elastic-runtime-<pid>``.
        result_path: where process 0 writes the final state (``.npz``).
        kills, kill_during_recovery: fault injection (see :class:`Kill`).
        worker_faults: fault injection in the first generation's process ids: {1: "midstep@12"}.
    """

    command: list[str]
    nprocs: int
    min_nprocs: int | None = None
    spares: int = 1
    local_devices: int = 2
    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 2.0
    hang_timeout_s: float = 5.0
    strategy: str = "reform"
    form_timeout_s: float = 20.0
    spawn_timeout_s: float = 60.0
    start_timeout_s: float = 120.0
    max_failures: int = 10
    run_dir: str | None = None
    replica_dir: str | None = None
    result_path: str | None = None
    kills: list[Kill] = field(default_factory=list)
    kill_during_recovery: int | None = None
    worker_faults: dict[int, str] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {self.nprocs}")
        if self.min_nprocs is None:
            self.min_nprocs = self.nprocs
        if not 1 <= self.min_nprocs <= self.nprocs:
            raise ValueError(f"min_nprocs must be in [1, {self.nprocs}], got {self.min_nprocs}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")


@dataclass
class LaunchResult:
    """What a run leaves: its outcome and the figures the demo's summary reports."""

    ok: bool
    step: int
    target_steps: int
    digests: dict[int, str]
    world_size_history: list[int]
    strategies: list[str]
    recoveries: list[dict[str, Any]]
    detected_after_s: list[float]
    controller_restarts: int
    survivor_restarts: int
    events_path: str
    run_dir: str
    reason: str = ""


@dataclass
class _Proc:
    worker: int
    popen: subprocess.Popen[bytes]
    spare: bool = True
    stream: SocketStream | None = None
    hello: Hello | None = None
    joined: Joined | None = None
    finished: Finished | None = None
    step: int = 0
    generation: int = 0
    gone: bool = False
    warmed: bool = False  # was sent Warm


@dataclass
class _Recovery:
    cause: str
    started: float
    failed_step: int
    lost: set[int]
    strategy: str = ""
    restore_step: int | None = None  # set once the new group is formed; until then no commit ends the recovery
    restored_from: str = ""
    lost_steps: int = 0


class ControllerContext:
    """What a controller-side handler sees as ``ctx``: the group, and the requests it may make."""

    def __init__(self, controller: Controller) -> None:
        self._c = controller

    @property
    def config(self) -> LaunchConfig:
        return self._c.config

    @property
    def step(self) -> int:
        """The newest step the whole group committed."""
        return self._c.group_step

    @property
    def members(self) -> tuple[int, ...]:
        """Worker ids of the current group, in process-id order."""
        return tuple(self._c.members)

    async def publish(self, event: Event) -> None:
        await self._c.bus.publish(event)

    def kill(self, worker: int, reason: str) -> None:
        """SIGKILL ``worker`` (a hung or stopped worker must not come back half-way through a re-forming)."""
        self._c.kill(worker, "KILL", reason)

    def regroup(self, lost: Iterable[int], reason: str, strategy: str | None = None) -> None:
        """Replace ``lost`` workers and re-form the group (queued; done by the controller's supervisor)."""
        self._c.request_regroup(set(lost), reason, strategy)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def start_coordination_service(port: int, num_processes: int, *, heartbeat_timeout_s: int = 30) -> Any:
    """Start a JAX coordination service for one generation of the group, here in the controller.

    JAX normally runs it inside process 0, whose loss then ends every other worker (their clients poll an
    error and terminate). Hosted by the controller, which is never restarted, it outlives any worker.
    ``recoverable``: a task that disappears is not an error for the others.
    """
    from runtime.compat import jax as jax_compat

    return jax_compat.distributed_runtime_service(
        f"127.0.0.1:{port}",
        num_processes,
        heartbeat_timeout=heartbeat_timeout_s,
        shutdown_timeout=2,
        recoverable=True,
    )


def _first_leaf(group: BaseExceptionGroup[Any], kind: type[BaseException]) -> BaseException | None:
    """The first exception of type ``kind`` in a (nested) exception group."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = _first_leaf(exc, kind)
            if found is not None:
                return found
        elif isinstance(exc, kind):
            return exc
    return None


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP): alive, silent, and making no progress."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


class Controller:
    """Starts, supervises and re-forms a group of worker processes. Single use."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="elastic-launch-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "workers").mkdir(exist_ok=True)
        self.replica_dir = config.replica_dir or f"/dev/shm/elastic-runtime-{os.getpid()}-{int(time.time())}"
        self.event_log = EventLog(self.run_dir / "events.jsonl")
        self.context = ControllerContext(self)
        self.bus = EventBus(self.context, handler_timeout=30.0, log=self.event_log)
        self.monitor = HeartbeatMonitor(timeout_s=config.heartbeat_timeout_s, hang_timeout_s=config.hang_timeout_s)
        self.procs: dict[int, _Proc] = {}
        self.members: list[int] = []
        self.generation = 0
        self.target_steps = -1
        self.group_step = 0
        self.high_water = 0
        self.port = 0
        self._next_worker = 0
        self._restored = False  # the current generation got its Restore
        self._requests: set[int] = set()
        self._request_reason = ""
        self._request_strategy: str | None = None
        self._wake = anyio.Event()
        self._finished = anyio.Event()
        self._recovery: _Recovery | None = None
        self._failures = 0
        self._kills = sorted(config.kills, key=lambda k: k.step)
        self._kill_during_recovery = config.kill_during_recovery
        self._kill_times: dict[int, float] = {}
        # Every generation's coordination service stays up until the run ends: stopping one while a live
        # worker's client is still attached makes that client terminate its process.
        self._services: list[Any] = []
        self._stopping = False
        self.result = LaunchResult(
            ok=False,
            step=0,
            target_steps=-1,
            digests={},
            world_size_history=[],
            strategies=[],
            recoveries=[],
            detected_after_s=[],
            controller_restarts=0,
            survivor_restarts=0,
            events_path=str(self.event_log.path),
            run_dir=str(self.run_dir),
        )
        self._subscribe_defaults()

    def _subscribe_defaults(self) -> None:
        from handlers.regroup import log_straggler, regroup_on_worker_failure

        self.bus.subscribe(WorkerLost, regroup_on_worker_failure)
        self.bus.subscribe(WorkerHung, regroup_on_worker_failure)
        self.bus.subscribe(Straggler, log_straggler)

    # --- running -------------------------------------------------------------------------------------------

    def run(self) -> LaunchResult:
        """Run in a new event loop. Raises LaunchError (unwrapped from the task group) when it cannot go on."""
        try:
            return anyio.run(self.run_async)
        except BaseExceptionGroup as group:
            error = _first_leaf(group, LaunchError)
            if error is not None:
                raise error from group
            raise

    async def run_async(self) -> LaunchResult:
        """Run the group to completion. Raises LaunchError when it cannot go on."""
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        reason = ""
        try:
            async with anyio.create_task_group() as tg:
                bus_done = anyio.Event()

                async def run_bus() -> None:
                    await self.bus.run()
                    bus_done.set()

                helpers = anyio.CancelScope()

                async def run_helpers() -> None:
                    # The wire, the monitor and the reaper publish events: they end before the bus closes.
                    with helpers:
                        async with anyio.create_task_group() as inner:
                            inner.start_soon(listener.serve, self._serve)
                            inner.start_soon(watch, self.monitor, self._on_verdict)
                            inner.start_soon(self._reap)

                tg.start_soon(run_bus)
                tg.start_soon(run_helpers)
                try:
                    for _ in range(self.config.nprocs + self.config.spares):
                        self._spawn()
                    await self._supervise()
                    self.result.ok = True
                except Exception as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                    raise
                finally:
                    self._stopping = True
                    for worker in self.monitor.workers:
                        self.monitor.forget(worker)
                    with anyio.CancelScope(shield=True):
                        await self._stop_all(reason or "run finished")
                        helpers.cancel()
                        for service in self._services:
                            await anyio.to_thread.run_sync(service.shutdown)
                        finished = RunFinished(
                            step=self.group_step,
                            source="controller",
                            ok=self.result.ok,
                            reason=reason or ("" if self.result.ok else "cancelled"),
                        )
                        try:
                            await self.bus.publish(finished)
                            await self.bus.close()
                            with anyio.move_on_after(5):
                                await bus_done.wait()  # every pending event dispatched and logged
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError, BusClosed):
                            self.event_log.append(finished)  # cancelled from outside: the bus is gone
                            await self.bus.close()
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            self.event_log.close()
            if self.config.replica_dir is None:  # ours, in /dev/shm: memory, not storage
                shutil.rmtree(self.replica_dir, ignore_errors=True)
        self.result.step = self.group_step
        self.result.target_steps = self.target_steps
        digests = {self.result.digests.get(w) for w in self.members}
        if self.result.ok and len(digests) != 1:
            # Replicas must agree bit for bit; if they do not, the run's result cannot be trusted.
            log.error("members %s finished with different states: %s", self.members, self.result.digests)
            self.result.ok, self.result.reason = False, "replicas diverged"
        (self.run_dir / "summary.json").write_text(json.dumps(self.result.__dict__, default=str))
        return self.result

    async def _supervise(self) -> None:
        await self._form(reason="start", strategy="start")
        while not self._finished.is_set():
            with anyio.move_on_after(0.5):
                await self._wake.wait()
            self._wake = anyio.Event()
            if self._requests:
                await anyio.sleep(0.05)  # let near-simultaneous losses arrive: one re-forming for all
                lost, self._requests = self._requests, set()
                await self._regroup(lost, self._request_reason, self._request_strategy)
            elif self._can_grow():
                await self._form(reason="a spare is ready", strategy="grow")

    def _can_grow(self) -> bool:
        """A group that shrank (``min_nprocs``) grows back once a spare is ready, away from the run's end."""
        ready = any(p.spare and not p.gone and p.hello is not None for p in self.procs.values())
        return (
            ready
            and len(self.members) < self.config.nprocs
            and self._recovery is None
            and self._restored
            and not self._stopping
            and self.group_step + 5 < self.target_steps
        )

    # --- processes -----------------------------------------------------------------------------------------

    def _spawn(self) -> _Proc:
        worker = self._next_worker
        self._next_worker += 1
        env = dict(os.environ)
        env.update(self.config.extra_env)
        env.update(
            {
                ENV_CONTROLLER: f"127.0.0.1:{self.port}",
                ENV_WORKER: str(worker),
                ENV_REPLICA_DIR: self.replica_dir,
                ENV_LOCAL_DEVICES: str(self.config.local_devices),
                ENV_HEARTBEAT_S: str(self.config.heartbeat_interval_s),
                ENV_COMPILE_CACHE: str(Path(self.replica_dir) / "xla-cache"),
            }
        )
        if self.config.result_path:
            env[ENV_RESULT] = self.config.result_path
        logfile = open(self.run_dir / "workers" / f"worker-{worker}.log", "wb")  # noqa: SIM115 - child owns it
        popen = subprocess.Popen(
            self.config.command, env=env, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True
        )
        logfile.close()
        proc = _Proc(worker=worker, popen=popen)
        self.procs[worker] = proc
        self._publish_nowait(WorkerStarted(source="controller", worker=worker, pid=popen.pid, spare=True))
        return proc

    def _publish_nowait(self, event: Event) -> None:
        try:
            self.bus.publish_nowait(event)
        except BusClosed:  # the run is over; nothing reads events any more
            log.debug("after the bus closed, dropped %s", type(event).__name__)

    def kill(self, worker: int, sig: str, reason: str) -> None:
        proc = self.procs.get(worker)
        if proc is None or proc.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.popen.pid, getattr(signal, f"SIG{sig}"))
        self._publish_nowait(
            WorkerKilled(step=self.group_step, source="controller", worker=worker, signal=sig, reason=reason)
        )

    async def _reap(self) -> None:
        """Notice exited processes at once: a local kill -9 needs no heartbeat timeout to be seen."""
        while True:
            for proc in list(self.procs.values()):
                code = proc.popen.poll()
                if code is not None and not proc.gone:
                    proc.gone = True
                    self.monitor.mark_gone(proc.worker, f"process exited with {code}")
                    await self.bus.publish(
                        WorkerExited(step=self.group_step, source="controller", worker=proc.worker, returncode=code)
                    )
            await anyio.sleep(0.02)

    async def _stop_all(self, reason: str) -> None:
        for proc in self.procs.values():
            if proc.stream is None and proc.popen.poll() is None:
                proc.popen.kill()  # still starting: nothing to save, no need to wait for its Hello
            if proc.stream is not None and proc.popen.poll() is None:
                with contextlib.suppress(Exception):
                    await proc.stream.send(encode(Stop(reason=reason)))
        with anyio.move_on_after(10):
            while any(p.popen.poll() is None for p in self.procs.values()):
                await anyio.sleep(0.05)
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                # SIGTERM alone does not stop a JAX process once jax.distributed is up (its preemption notifier).
                proc.popen.kill()
                proc.popen.wait()

    # --- the wire ------------------------------------------------------------------------------------------

    async def _serve(self, stream: SocketStream) -> None:
        peer = "unknown"
        with contextlib.suppress(Exception):
            peer = "%s:%s" % stream.extra(anyio.abc.SocketAttribute.remote_address)  # noqa: UP031
        reader = BufferedByteReceiveStream(stream)
        proc: _Proc | None = None
        bad = 0
        try:
            while True:
                try:
                    line = await reader.receive_until(b"\n", MAX_LINE)
                except anyio.DelimiterNotFound:
                    await self._malformed(peer, f"a line longer than {MAX_LINE} bytes; connection closed")
                    return
                try:
                    message = decode_from_worker(line)
                except MalformedMessage as exc:
                    bad += 1
                    await self._malformed(peer, str(exc))
                    if bad >= 100:
                        await self._malformed(peer, "100 malformed lines; connection closed")
                        return
                    continue
                if proc is None:
                    proc = await self._hello(message, stream, peer)
                    if proc is None:
                        return
                    continue
                if getattr(message, "worker", proc.worker) != proc.worker:
                    await self._malformed(peer, f"worker {proc.worker}'s connection sent {message!r}; ignored")
                    continue
                await self._on_message(proc, message)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
            pass
        finally:
            if proc is not None:
                self.monitor.mark_gone(proc.worker, "connection closed")
            await stream.aclose()

    async def _malformed(self, peer: str, reason: str) -> None:
        log.warning("controller: ignored message from %s: %s", peer, reason)
        await self.bus.publish(
            MalformedHeartbeat(step=self.group_step, source="controller", peer=peer, reason=reason, message=reason)
        )

    async def _hello(self, message: Message, stream: SocketStream, peer: str) -> _Proc | None:
        if not isinstance(message, Hello):
            await self._malformed(peer, f"first message must be Hello, got {type(message).__name__}; closed")
            return None
        proc = self.procs.get(message.worker)
        if proc is None or proc.stream is not None or proc.gone:
            await self._malformed(peer, f"unknown worker id {message.worker} (or already connected); closed")
            return None
        proc.stream, proc.hello = stream, message
        if self._stopping:
            await self._send(proc, Stop(reason="the run is over"))
            return proc
        if self._restored:
            await self._warm_spares()
        if self.target_steps < 0:
            self.target_steps = message.target_steps
        self.monitor.register(proc.worker)
        self._wake.set()
        return proc

    async def _on_message(self, proc: _Proc, message: Message) -> None:
        match message:
            case Heartbeat(worker=worker, generation=gen, step=step, step_time_s=seconds):
                if proc.gone or self._stopping:
                    return
                try:
                    self.monitor.observe(worker, step, seconds)
                except UnknownWorker:
                    log.warning("controller: heartbeat from worker %d, which is not watched; ignored", worker)
                    return
                if gen == self.generation and worker in self.members:
                    proc.step, proc.generation = step, gen
                    await self._progress(seconds)
            case Joined(generation=gen) if gen == self.generation:
                proc.joined = message
                self._wake.set()
            case Finished(generation=gen) if gen == self.generation:
                proc.finished = message
                self.result.digests[proc.worker] = message.digest
                if all(self.procs[w].finished is not None for w in self.members):
                    self._stopping = True
                    self._finished.set()
                    self._wake.set()
            case _:
                log.info("controller: stale %s from worker %d ignored", type(message).__name__, proc.worker)

    async def _send(self, proc: _Proc, message: Message) -> None:
        if proc.stream is None:
            return
        try:
            await proc.stream.send(encode(message))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self.monitor.mark_gone(proc.worker, f"send failed: {exc}")

    # --- progress and failures -----------------------------------------------------------------------------

    async def _progress(self, step_time_s: float | None) -> None:
        if not self._restored or not self.members:
            return
        step = min(self.procs[w].step for w in self.members)
        while self.group_step < step:
            self.group_step += 1
            self.high_water = max(self.high_water, self.group_step)
            await self.bus.publish(
                StepCompleted(
                    step=self.group_step,
                    source="controller",
                    duration_s=step_time_s or 0.0,
                    mesh_shape={"data": len(self.members), "model": self.config.local_devices},
                    data_position=self.group_step,
                )
            )
            recovery = self._recovery
            # A step the old group commits while the failure waits for a re-form (its members had all reported
            # it) advances the group, but only a step past the new group's restore point ends the recovery.
            if recovery is not None and recovery.restore_step is not None and self.group_step > recovery.restore_step:
                self._recovery = None
                seconds = time.monotonic() - recovery.started
                record = {
                    "cause": recovery.cause,
                    "strategy": recovery.strategy,
                    "recovery_s": seconds,
                    "lost_steps": recovery.lost_steps,
                    "restored_from": recovery.restored_from,
                    "failed_step": recovery.failed_step,
                }
                self.result.recoveries.append(record)
                await self.bus.publish(
                    RecoveryCompleted(
                        step=self.group_step,
                        source="controller",
                        cause=recovery.cause,
                        failed_step=recovery.failed_step,
                        recovery_s=seconds,
                        lost_steps=recovery.lost_steps,
                        restored_from=recovery.restored_from,
                        mesh_shape={"data": len(self.members), "model": self.config.local_devices},
                    )
                )
            await self._inject(self.group_step)

    async def _inject(self, step: int) -> None:
        while self._kills and self._kills[0].step <= step:
            kill = self._kills.pop(0)
            if kill.process_id < len(self.members):
                worker = self.members[kill.process_id]
                self._kill_times[worker] = time.monotonic()
                self.kill(worker, kill.signal, f"fault injection at step {step}")

    async def _on_verdict(self, verdict: Verdict) -> None:
        proc = self.procs.get(verdict.worker)
        event = verdict_event(verdict, step=self.group_step)
        if isinstance(verdict, Lost) and proc is not None and proc.popen.poll() is None and _stopped(proc.popen.pid):
            event = WorkerHung(
                step=self.group_step,
                source="heartbeat",
                worker=verdict.worker,
                stalled_s=verdict.silent_s,
                message=f"process {proc.popen.pid} is stopped (SIGSTOP?) and silent for {verdict.silent_s:.2f} s",
            )
        killed = self._kill_times.pop(verdict.worker, None)
        if killed is not None:
            self.result.detected_after_s.append(event.mono_time - killed)
        await self.bus.publish(event)

    def request_regroup(self, lost: set[int], reason: str, strategy: str | None) -> None:
        if self._stopping:
            return
        for worker in lost:
            self.monitor.forget(worker)
            proc = self.procs.get(worker)
            if proc is not None:
                proc.gone = True
            if worker not in self.members:
                # A spare (or an already replaced worker): keep the pool of spares full, no re-forming.
                self._top_up_spares()
                continue
            self._requests.add(worker)
        if self._recovery is None and self._requests:
            self._failures += 1
            self._recovery = _Recovery(
                cause=reason, started=time.monotonic(), failed_step=self.group_step + 1, lost=set(lost)
            )
            self._publish_nowait(
                RecoveryStarted(
                    step=self.group_step + 1, source="controller", cause=reason, last_committed_step=self.group_step
                )
            )
        self._request_reason = reason
        self._request_strategy = strategy or self._request_strategy
        self._wake.set()

    async def _warm_spares(self) -> None:
        """Idle spares compile the step once now, rather than when they are needed."""
        for proc in self.procs.values():
            if proc.spare and not proc.gone and proc.hello is not None and not proc.warmed:
                proc.warmed = True
                await self._send(proc, Warm())

    def _top_up_spares(self) -> None:
        alive_spares = [p for p in self.procs.values() if p.spare and not p.gone and p.popen.poll() is None]
        for _ in range(self.config.spares - len(alive_spares)):
            self._spawn()

    # --- forming groups ------------------------------------------------------------------------------------

    async def _regroup(self, lost: set[int], reason: str, strategy: str | None) -> None:
        if self._failures > self.config.max_failures:
            raise LaunchError(f"{self._failures} failures exceed max_failures={self.config.max_failures}")
        strategy = strategy or self.config.strategy
        self._request_strategy = None
        await self._form(reason=reason, strategy=strategy)

    async def _form(self, *, reason: str, strategy: str) -> None:
        """Form a new generation of the group; on a member lost meanwhile, form again; falls back to restart."""
        while True:
            started = time.monotonic()
            survivors = [w for w in self.members if not self.procs[w].gone and w not in self._requests]
            if strategy == "restart":
                for worker in survivors:
                    self.kill(worker, "KILL", "restart strategy: every worker is replaced")
                    self.procs[worker].gone = True
                    self.monitor.forget(worker)
                self.result.survivor_restarts += len(survivors)
                survivors = []
            elif strategy == "reform" and not survivors:
                strategy = "restart"  # nobody left to re-form with: the state must come from the replica files
            recruits = await self._recruit(
                survivors, self.config.start_timeout_s if strategy == "start" else self.config.spawn_timeout_s
            )
            members = self._seat(survivors, recruits)
            self._requests.clear()
            self.generation += 1
            self._restored = False
            self.members = members
            for worker in members:
                proc = self.procs[worker]
                proc.spare, proc.joined, proc.finished = False, None, None
                self.monitor.expect_progress(worker, False)
            # Growing is planned: every member re-forms after committing the same step, so no collective is
            # cut off; after a failure the group re-forms now (in-flight steps are abandoned).
            at_step = max(self.procs[w].step for w in survivors) + 3 if strategy == "grow" and survivors else -1
            port, service = self._new_service(len(members))
            self._services.append(service)
            coordinator = f"127.0.0.1:{port}"
            for process_id, worker in enumerate(members):
                form = Form(
                    generation=self.generation,
                    coordinator=coordinator,
                    process_id=process_id,
                    num_processes=len(members),
                    read_files=strategy != "reform",
                    faults=self.config.worker_faults.get(process_id, "") if strategy == "start" else "",
                    at_step=at_step,
                )
                await self._send(self.procs[worker], form)
            if self._kill_during_recovery is not None and strategy != "start":
                target = members[min(self._kill_during_recovery, len(members) - 1)]
                self._kill_during_recovery = None
                self._kill_times[target] = time.monotonic()
                self.kill(target, "KILL", "fault injection during recovery")
            outcome = await self._await_joins(members)
            if outcome == "joined":
                break
            # A member died or stalled while the group formed. Members blocked in initialize() wait for it
            # until JAX's initialization timeout, so they are replaced too: fall back to restarting.
            log.warning("generation %d did not form (%s); restarting its workers", self.generation, outcome)
            strategy = "restart"
            if self._recovery is None:
                self._recovery = _Recovery(cause=outcome, started=started, failed_step=self.group_step + 1, lost=set())
        await self._restore(members, strategy, coordinator, started)
        # Only now: a new spare importing JAX would compete for the CPUs with the re-forming group.
        self._top_up_spares()

    def _seat(self, survivors: list[int], recruits: list[int]) -> list[int]:
        """The new group in process-id order: survivors keep their process ids, recruits take the free ones.

        Stable ids mean the same device layout as before on every survivor, so each loads its step from the
        persistent compilation cache instead of compiling it again, and the numerics do not change.
        """
        seats: list[int | None] = [w if w in survivors else None for w in self.members]
        seats.extend([None] * max(0, self.config.nprocs - len(seats)))
        queue = list(recruits)
        for i, worker in enumerate(seats):
            if worker is None and queue:
                seats[i] = queue.pop(0)
        return [w for w in seats if w is not None] + queue

    def _new_service(self, num_processes: int, attempts: int = 5) -> tuple[int, Any]:
        """A coordination service on a free port; another port if the chosen one was taken meanwhile."""
        for attempt in range(attempts):
            port = free_port()
            try:
                return port, start_coordination_service(port, num_processes)
            except Exception as exc:  # port taken between free_port() and the bind (shared machine)
                log.warning("coordination service on port %d failed (attempt %d): %s", port, attempt + 1, exc)
        raise LaunchError(f"could not start a coordination service in {attempts} attempts")

    async def _recruit(self, survivors: list[int], timeout_s: float) -> list[int]:
        """Enough spares (started now if needed) to fill the group around ``survivors``; waits for their Hello."""
        need = self.config.nprocs - len(survivors)
        chosen: list[int] = []
        deadline = time.monotonic() + timeout_s
        while len(chosen) < need:
            ready = [
                p.worker
                for p in self.procs.values()
                if p.spare and not p.gone and p.hello is not None and p.worker not in chosen
            ]
            chosen.extend(ready[: need - len(chosen)])
            if len(chosen) >= need:
                break
            starting = [p for p in self.procs.values() if p.spare and not p.gone and p.hello is None]
            if len(starting) + len(chosen) < need:
                self._spawn()
                continue
            if time.monotonic() > deadline:
                assert self.config.min_nprocs is not None
                if len(survivors) + len(chosen) >= self.config.min_nprocs:
                    break  # go on smaller; the next re-forming grows the group back
                raise LaunchError(f"only {len(survivors) + len(chosen)} workers ready after {timeout_s} s")
            with anyio.move_on_after(0.1):
                await self._wake.wait()
            self._wake = anyio.Event()
        return chosen

    async def _await_joins(self, members: list[int]) -> str:
        deadline = time.monotonic() + self.config.form_timeout_s
        while True:
            procs = [self.procs[w] for w in members]
            if any(p.gone for p in procs):
                return "member lost while forming"
            if all(p.joined is not None for p in procs):
                return "joined"
            if time.monotonic() > deadline:
                return f"not joined within {self.config.form_timeout_s} s"
            await anyio.sleep(0.01)

    async def _restore(self, members: list[int], strategy: str, coordinator: str, started: float) -> None:
        joined = [self.procs[w].joined for w in members]
        assert all(j is not None for j in joined)
        best = max(range(len(members)), key=lambda i: (joined[i].best_step, -i))  # type: ignore[union-attr]
        source = joined[best]
        assert source is not None
        step = source.best_step
        recovery = self._recovery
        lost_steps = max(0, self.high_water - step)
        restored_from = "init" if source.tier == "none" else source.tier
        if any(j is not None and j.best_step < step for j in joined):
            restored_from += "+peer"
        for gap in range(self.group_step + 1, step + 1):
            # Committed by the member(s) restored from before the old group could report them all: the new
            # group continues from them, so they count as the group's committed steps.
            await self.bus.publish(
                StepCompleted(
                    step=gap,
                    source="controller",
                    duration_s=0.0,
                    mesh_shape={"data": len(self.members), "model": self.config.local_devices},
                    data_position=gap,
                )
            )
        self.high_water = max(self.high_water, step)
        self.group_step = step
        for worker in members:
            self.procs[worker].step = step
        for worker in members:
            await self._send(
                self.procs[worker],
                Restore(
                    generation=self.generation,
                    step=step,
                    source=best if step > 0 else -1,
                    target_steps=self.target_steps,
                ),
            )
        self._restored = True
        for worker in members:
            self.monitor.expect_progress(worker, True)
        await self._warm_spares()
        self.result.world_size_history.append(len(members))
        self.result.strategies.append(strategy)
        seconds = time.monotonic() - started
        await self.bus.publish(
            GroupFormed(
                step=step,
                source="controller",
                generation=self.generation,
                members=tuple(members),
                coordinator=coordinator,
                strategy=strategy,
                seconds=seconds,
                restore_step=step,
                restore_source=best,
            )
        )
        if strategy == "start":
            await self.bus.publish(
                RunStarted(
                    step=step,
                    source="controller",
                    target_steps=self.target_steps,
                    mesh_shape={"data": len(members), "model": self.config.local_devices},
                    devices=tuple(range(len(members) * self.config.local_devices)),
                )
            )
        if recovery is not None:
            recovery.strategy, recovery.restore_step = strategy, step
            recovery.restored_from, recovery.lost_steps = restored_from, lost_steps
            await self.bus.publish(
                StateRestored(
                    step=step,
                    source="controller",
                    restored_from=restored_from,
                    lost_steps=lost_steps,
                    seconds=time.monotonic() - recovery.started,
                )
            )
        if self.target_steps >= 0 and step >= self.target_steps:
            self._wake.set()


# --- the command line --------------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "launch",
        help="run a training script as N supervised worker processes",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--nprocs", type=int, required=True, help="worker processes in the group")
    parser.add_argument("--min-nprocs", type=int, default=None, help="smallest group to go on with")
    parser.add_argument("--spares", type=int, default=1, help="warm spare processes (default 1)")
    parser.add_argument("--local-devices", type=int, default=2, help="CPU devices per worker (default 2)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="reform")
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0, help="seconds of silence = lost")
    parser.add_argument("--hang-timeout", type=float, default=5.0, help="seconds without progress = hung")
    parser.add_argument("--run-dir", default=None, help="event log, worker logs, summary.json")
    parser.add_argument("--result", default=None, help="where process 0 writes the final state (.npz)")
    parser.add_argument(
        "--replica-dir", default=None, help="replica files (default: a fresh /dev/shm dir, removed at the end)"
    )
    parser.add_argument("--max-failures", type=int, default=10, help="failures survived (0: stop at the first)")
    parser.add_argument("--kill", type=Kill.parse, action="append", default=[], metavar="STEP[:PID[:SIG]]")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")
    parser.set_defaults(func=launch_main)
    return parser


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("elastic-runtime launch: give the worker command after --")
    return LaunchConfig(
        command=command,
        nprocs=args.nprocs,
        min_nprocs=args.min_nprocs,
        spares=args.spares,
        local_devices=args.local_devices,
        strategy=args.strategy,
        heartbeat_timeout_s=args.heartbeat_timeout,
        hang_timeout_s=args.hang_timeout,
        run_dir=args.run_dir,
        result_path=args.result,
        replica_dir=args.replica_dir,
        max_failures=args.max_failures,
        kills=args.kill,
    )


def launch_main(args: argparse.Namespace) -> int:
    try:
        result = Controller(config_from_args(args)).run()
    except (LaunchError, ValueError) as exc:
        print(f"elastic-runtime launch: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in result.__dict__.items() if k != "digests"}, default=str))
    return 0 if result.ok else 1
