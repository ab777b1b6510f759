"""Simulated workers: thousands of them in one process, speaking the real protocol over loopback, without JAX.

Each :class:`SimWorker` is one connection to a real controller (``elastic-runtime controller --listen``, the
service mode): it proves the run's secret (``elastic_runtime.cluster.auth``), says ``Hello``, sends a ``Heartbeat``
every interval, answers ``Form`` with ``Joined`` and ``RestoreStep`` with ``Restored``, and counts steps on the clock
once restored. A :class:`Fleet` runs them all on one asyncio loop: one timer sends every heartbeat (workers
spread evenly over the interval, by id), so the loop holds no timer per connection. It can lose any set of
workers at once (:meth:`Fleet.lose`: close the connection, go silent, or stop answering ``Form``), heal a
silent set, and bring replacements with new ids. Each worker records when it was told what, for the
benchmark (``tests/benchmarks/bench_controller_scale.py``) and the tests.

The controller hosts no JAX coordination service for such a group when started with
``ELASTIC_SIMULATED_WORKERS=1`` (``elastic_runtime.cluster.controller.coordination``).

asyncio's protocols rather than anyio's streams: the load generator must cost far less than what it measures.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from elastic_runtime.cluster import auth
from elastic_runtime.cluster.controller.coordination import ENV_SIMULATED, free_port
from elastic_runtime.cluster.protocol import (
    EXIT_REPLACE,
    Finished,
    Form,
    Heartbeat,
    Hello,
    Joined,
    MalformedMessage,
    Message,
    Restored,
    RestoreStep,
    Stop,
    decode_from_controller,
    encode,
)
from elastic_runtime.cluster.tiers import Tier
from elastic_runtime.core.errors import AuthenticationFailed

__all__ = ["Fleet", "Loss", "SimWorker", "Told", "start_controller"]

_TICK_S = 0.01  # the heartbeat timer's period: workers are spread over the interval in slots this long
_HANDSHAKE_TRIES = 5  # as the real worker: the controller may close a waiting handshake to make room


class Loss(StrEnum):
    """How a simulated worker is lost."""

    CLOSE = "close"  # its connection closes (the process died; the kernel closed its socket)
    SILENT = "silent"  # it sends nothing and reads nothing, its connection open (a lost host, a partition)
    MUTE = "mute"  # it heartbeats but never answers Form (stuck joining the group)


@dataclass
class Told:
    """When (monotonic seconds) a worker received a controller message of ``generation``."""

    generation: int
    at: float
    processes: int = 0  # a Form's group size


@dataclass
class _Record:
    welcomed_at: float = 0.0  # the controller accepted its proof
    forms: list[Told] = field(default_factory=list)
    restores: list[Told] = field(default_factory=list)
    stopped: Stop | None = None
    stopped_at: float = 0.0
    last_heartbeat_at: float = 0.0  # when it last sent one
    lost_at: float = 0.0  # when it was made to fail
    silent_since: float = 0.0  # its last heartbeat before it was made to fail
    closed_at: float = 0.0


class SimWorker(asyncio.Protocol):
    """One simulated worker process: its connection, its protocol state and its record."""

    def __init__(self, fleet: Fleet, worker: int) -> None:
        self.fleet = fleet
        self.worker = worker
        self.record = _Record()
        self.transport: asyncio.Transport | None = None
        self.ready = False  # proved the secret and said hello
        self.loss: Loss | None = None
        self.generation = 0
        self.stepping = False
        self._base_step = 0  # restored step
        self._base_at = 0.0  # when it was restored
        self._frozen_step = 0
        self._finished = False
        self._buffer = b""
        self._expected = ""  # the controller's proof its welcome must carry; "" before the challenge
        self.refused = False  # the controller closed it during the handshake
        self.connected = asyncio.get_running_loop().create_future()

    # --- the protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.loss == Loss.SILENT:
            return
        self._buffer += data
        while True:
            line, sep, rest = self._buffer.partition(b"\n")
            if not sep:
                return
            self._buffer = rest
            self._line(line + b"\n")

    def connection_lost(self, exc: Exception | None) -> None:
        self.record.closed_at = time.monotonic()
        if not self.ready:
            self.refused = True
        self.ready = False
        self.transport = None
        if not self.connected.done():
            self.connected.set_result(False)

    def _line(self, line: bytes) -> None:
        if not self.ready:
            self._handshake(line)
            return
        try:
            message = decode_from_controller(line)
        except MalformedMessage:
            return
        now = time.monotonic()
        match message:
            case Form(generation=generation, at_step=at_step, num_processes=processes):
                self.record.forms.append(Told(generation, now, processes))
                if self.loss == Loss.MUTE:
                    return
                step = self.step(now)
                self.stepping, self._frozen_step, self.generation = False, step, generation
                del at_step  # joins at once: a simulated step has nothing to finish
                tier = Tier.RAM if step > 0 else Tier.NONE
                steps = (step,) if step > 0 else ()
                self.send(
                    Joined(
                        worker=self.worker, generation=generation, best_step=step, tier=tier, steps=steps, join_s=0.0
                    )
                )
            case RestoreStep(generation=generation, step=step):
                self.record.restores.append(Told(generation, now))
                if generation != self.generation:
                    return
                self.stepping, self._base_step, self._base_at = True, step, now
                tier = Tier.RAM if step > 0 else Tier.NONE
                self.send(Restored(worker=self.worker, generation=generation, step=step, tier=tier, nbytes=0))
            case Stop():
                self.record.stopped, self.record.stopped_at = message, now
                self.close()
            case _:
                pass  # Lease, Warm, DurableCommitted, Notify: nothing to simulate

    def _handshake(self, line: bytes) -> None:
        try:
            if not self._expected:
                answer, self._expected = auth.answer(self.fleet.secret, line)
                self._write(auth.encode(answer))
                return
            auth.check_welcome(self._expected, line)
        except AuthenticationFailed:
            self.close()
            return
        self.ready = True
        self.record.welcomed_at = time.monotonic()
        self.send(Hello(worker=self.worker, pid=os.getpid(), target_steps=self.fleet.target_steps))
        if not self.connected.done():
            self.connected.set_result(True)

    # --- acting ---

    def step(self, now: float) -> int:
        """The newest step it committed: counted on the clock since its restore, up to the target."""
        if not self.stepping:
            return self._frozen_step
        step = self._base_step + int((now - self._base_at) / self.fleet.step_s)
        return min(step, self.fleet.target_steps)

    def send(self, message: Message) -> None:
        self._write(encode(message))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def heartbeat(self, now: float) -> None:
        if not self.ready or self.loss == Loss.SILENT:
            return
        step = self.step(now)
        self.record.last_heartbeat_at = now
        self.send(
            Heartbeat(
                worker=self.worker,
                generation=self.generation,
                step=step,
                step_time_s=self.fleet.step_s,
                sent_at=time.time(),
            )
        )
        if step >= self.fleet.target_steps and self.stepping and not self._finished:
            self._finished = True
            self.send(Finished(worker=self.worker, generation=self.generation, step=step, digest="simulated"))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Fleet:
    """Simulated workers on one event loop, connected to the controller at ``address``.

    Args:
        address: the controller's ``host:port``.
        secret: the run's secret.
        interval_s: heartbeat interval.
        step_s: seconds per simulated step.
        target_steps: the run's target, said in every ``Hello``.
        connecting: connections opened at once (the rest wait their turn).
    """

    def __init__(
        self,
        address: str,
        secret: str,
        *,
        interval_s: float = 0.5,
        step_s: float = 0.1,
        target_steps: int = 1_000_000_000,
        connecting: int = 256,
    ) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port = host, int(port)
        self.secret = secret
        self.interval_s = interval_s
        self.step_s = step_s
        self.target_steps = target_steps
        self.workers: dict[int, SimWorker] = {}
        self._slots = max(1, round(interval_s / _TICK_S))
        self._by_slot: list[list[SimWorker]] = [[] for _ in range(self._slots)]
        self._gate = asyncio.Semaphore(connecting)
        self._next_id = 0
        self._beating: asyncio.Task[None] | None = None

    # --- joining ---

    async def start(self, count: int) -> list[int]:
        """Connect ``count`` new workers (ids after any so far) at once; their ids. Raises OSError if one cannot
        prove the secret in a few tries."""
        ids = list(range(self._next_id, self._next_id + count))
        self._next_id += count
        if self._beating is None:
            self._beating = asyncio.get_running_loop().create_task(self._beat())
        await asyncio.gather(*(self._connect(w) for w in ids))
        return ids

    async def replace(self, count: int) -> list[int]:
        """Bring ``count`` replacements (new ids, as a cluster scheduler would)."""
        return await self.start(count)

    async def _connect(self, worker: int) -> None:
        loop = asyncio.get_running_loop()
        for attempt in range(_HANDSHAKE_TRIES):
            sim = SimWorker(self, worker)
            async with self._gate:
                try:
                    await loop.create_connection(lambda s=sim: s, self.host, self.port)  # type: ignore[misc]
                except OSError:
                    await asyncio.sleep(0.2 * (attempt + 1))
                    continue
                if await sim.connected:
                    self.workers[worker] = sim
                    self._by_slot[worker % self._slots].append(sim)
                    return
            await asyncio.sleep(0.2 * (attempt + 1))
        raise OSError(f"simulated worker {worker} was not accepted by the controller in {_HANDSHAKE_TRIES} tries")

    async def _beat(self) -> None:
        """Every heartbeat of the fleet, from one timer: slot k's workers at k * tick into each interval."""
        loop = asyncio.get_running_loop()
        slot, due = 0, loop.time()
        while True:
            now = loop.time()
            while due <= now:
                for sim in self._by_slot[slot]:
                    sim.heartbeat(now)
                slot, due = (slot + 1) % self._slots, due + _TICK_S
            await asyncio.sleep(max(0.0, due - loop.time()))

    # --- failing ---

    def lose(self, workers: Iterable[int], how: Loss) -> float:
        """Make ``workers`` fail at once, ``how``; the time it happened."""
        now = time.monotonic()
        for worker in workers:
            sim = self.workers[worker]
            sim.record.lost_at, sim.record.silent_since = now, sim.record.last_heartbeat_at
            sim.loss = how
            if how == Loss.CLOSE:
                sim.close()
        return now

    def heal(self, workers: Iterable[int]) -> None:
        """Silent workers speak again (a partition heals); what the controller sent meanwhile is lost."""
        for worker in workers:
            self.workers[worker].loss = None

    # --- looking ---

    def alive(self) -> list[SimWorker]:
        """Workers connected, not made to fail, not stopped."""
        return [s for s in self.workers.values() if s.ready and s.loss is None and s.record.stopped is None]

    async def until(self, condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.02) -> float:
        """Wait until ``condition()`` holds; the time it did. Raises TimeoutError naming ``what``."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not within {timeout_s} s: {what}")
            await asyncio.sleep(poll_s)
        return time.monotonic()

    def told(self, generation: int, workers: Iterable[int], restore: bool = False) -> bool:
        """Whether every one of ``workers`` received generation ``generation``'s Form (or RestoreStep)."""
        for worker in workers:
            record = self.workers[worker].record
            if not any(t.generation == generation for t in (record.restores if restore else record.forms)):
                return False
        return True

    def replaced(self) -> list[int]:
        """Workers the controller told to exit because their place was taken."""
        return [
            w
            for w, s in self.workers.items()
            if s.record.stopped is not None and s.record.stopped.exit_code == EXIT_REPLACE
        ]

    async def close(self) -> None:
        """Close every connection and stop the heartbeat timer."""
        if self._beating is not None:
            self._beating.cancel()
        for sim in self.workers.values():
            sim.close()
        await asyncio.sleep(0)


def start_controller(
    nprocs: int, run_dir: Path, secret: str, *, interval_s: float = 0.5, args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """The real controller, ``elastic-runtime controller`` in service mode, for ``nprocs`` simulated workers (no
    JAX coordination service), logging to ``run_dir/controller.log``; it and its ``host:port`` once it listens.
    ``args``: more of its options. Raises RuntimeError if it does not come up within a minute."""
    port = free_port()
    command = [sys.executable, "-m", "elastic_runtime.cli", "controller", "--listen", f"127.0.0.1:{port}"]
    command += ["--nprocs", str(nprocs), "--heartbeat-interval", str(interval_s), "--run-dir", str(run_dir), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update({auth.ENV_TOKEN: secret, ENV_SIMULATED: "1"})
    with open(run_dir / "controller.log", "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log_text = (run_dir / "controller.log").read_text()[-2000:]
                raise RuntimeError(f"the controller did not come up: {log_text}") from None
            time.sleep(0.05)
