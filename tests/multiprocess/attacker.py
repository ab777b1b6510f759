"""A local process that does not know the run's secret, attacking the controller's port (tests and chaos).

Each attack is what an earlier version let any local user do (issue 17): say ``Hello`` for the ids the
controller hands out, forge a ``Heartbeat(step=600)`` and ``Finished``, ask for ``target_steps=1``, poll the
next ids for a fresh spare's ``Warm``, open hundreds of idle connections, flood malformed lines; and, from
another simulated host (``attacker_main.py``, test_hosts_attacked.py): garbage bytes, a 10 MB line, protocol
messages without the handshake, a recorded proof replayed. Blocking sockets, run in a thread next to the
controller or in a process of their own. Every connection must end closed by the controller, and
the only thing it may ever have received is the handshake's ``Challenge``.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from elastic_runtime.cluster.auth import Answer, Challenge
from elastic_runtime.cluster.protocol import Finished, Heartbeat, Hello, Joined, encode

_challenge = msgspec.json.Decoder(Challenge)


@dataclass
class Attacker:
    """Attacks on ``host:port`` (from ``source``'s address if given); ``connections`` counts the ones opened,
    ``challenges`` the handshake challenges received on them, ``problems`` what the controller let through."""

    port: int
    timeout_s: float = 30.0
    host: str = "127.0.0.1"
    source: str | None = None
    connections: int = 0
    challenges: int = 0
    problems: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _open(self) -> socket.socket | None:
        try:
            source = (self.source, 0) if self.source else None
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s, source_address=source)
        except OSError:
            return None  # the run is over: the listener is closed
        with self._lock:
            self.connections += 1
        return sock

    def _finish(self, sock: socket.socket, what: str) -> None:
        """Read until the controller closes ``sock``; anything but a Challenge got through."""
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            self._problem(f"{what}: still open after {self.timeout_s} s")
        except OSError:
            pass  # reset by the controller: closed
        finally:
            sock.close()
        for line in received.splitlines():
            try:
                _challenge.decode(line)
            except msgspec.MsgspecError:
                self._problem(f"{what}: the controller sent {line[:100]!r}")
            else:
                with self._lock:
                    self.challenges += 1

    def _problem(self, text: str) -> None:
        with self._lock:
            self.problems.append(text)

    def _send(self, lines: list[bytes], what: str) -> None:
        sock = self._open()
        if sock is None:
            return
        with contextlib.suppress(OSError):  # the controller may close it before the last line
            for line in lines:
                sock.sendall(line)
        self._finish(sock, what)

    def impostor_hello(self, worker: int) -> None:
        """The old takeover: Hello for ``worker``, Joined, Heartbeat(step=600) and Finished, no handshake."""
        lines = [
            encode(Hello(worker=worker, pid=1, target_steps=600)),
            encode(Joined(worker=worker, generation=1, best_step=600, tier="ram", join_s=0.0)),
            encode(Heartbeat(worker=worker, generation=1, step=600, sent_at=0.0)),
            encode(Finished(worker=worker, generation=1, step=600, digest="forged")),
        ]
        self._send(lines, f"impostor Hello for worker {worker}")

    def guess_proof(self, worker: int) -> None:
        """Answer the challenge with a made-up proof, then ask for ``target_steps=1`` as ``worker``."""
        answer = msgspec.json.encode(Answer(nonce="a" * 32, proof="0" * 64)) + b"\n"
        self._send([answer, encode(Hello(worker=worker, pid=1, target_steps=1))], f"guessed proof for {worker}")

    def malformed_flood(self, lines: int) -> None:
        """``lines`` malformed lines on one connection, then one malformed line on each of ``lines // 10``."""
        self._send([b"\xff not json at all\n"] * lines, "malformed flood")
        for _ in range(lines // 10):
            self._send([b'{"type": "Heartbeat"}\n'], "malformed line")

    def garbage(self, count: int, size: int = 4096) -> None:
        """``count`` connections that each send ``size`` random bytes (the same on every run)."""
        noise = random.Random(0)
        for _ in range(count):
            self._send([noise.randbytes(size)], "garbage bytes")

    def long_line(self, count: int, size: int = 10 << 20) -> None:
        """``count`` connections that each send one line of ``size`` bytes (10 MB)."""
        line = b"x" * (size - 1) + b"\n"
        for _ in range(count):
            self._send([line], f"a {size}-byte line")

    def no_proof(self, worker: int) -> None:
        """Well-formed protocol messages for ``worker`` as the first lines: a Heartbeat(step=600) and a Finished."""
        lines = [
            encode(Heartbeat(worker=worker, generation=1, step=600, sent_at=0.0)),
            encode(Finished(worker=worker, generation=1, step=600, digest="forged")),
        ]
        self._send(lines, f"messages without the handshake for worker {worker}")

    def replay(self, answer: bytes, worker: int, count: int) -> None:
        """A recorded ``Answer`` line (a real proof of the secret, for another connection's nonce) sent again on
        ``count`` connections, each followed by a Hello for ``worker``."""
        for _ in range(count):
            self._send([answer, encode(Hello(worker=worker, pid=1, target_steps=1))], "replayed proof")

    def idle(self, count: int) -> None:
        """``count`` connections that never send a byte; each must be closed by the controller."""
        socks = [sock for sock in (self._open() for _ in range(count)) if sock is not None]
        for sock in socks:
            self._finish(sock, "idle connection")

    def poll(self, workers: range, stop: threading.Event, interval_s: float = 0.2) -> None:
        """Claim each of ``workers`` (a fresh spare's id among them), again and again until ``stop``."""
        while not stop.wait(interval_s):
            for worker in workers:
                self._send([encode(Hello(worker=worker, pid=1, target_steps=1))], f"polling for worker {worker}")

    def impostors(self, workers: int, stop: threading.Event) -> None:
        """An impostor Hello (with a forged Heartbeat and Finished) and a guessed proof for each of ``workers``
        ids at once, right after launch."""
        attacks = [threading.Thread(target=self.impostor_hello, args=(w,)) for w in range(workers)]
        attacks += [threading.Thread(target=self.guess_proof, args=(w,)) for w in range(workers)]
        _run_all(attacks)

    def everything(self, workers: int, stop: threading.Event) -> None:
        """Every attack above at once, right after launch; polling goes on until ``stop``."""
        attacks = [threading.Thread(target=self.impostors, args=(workers, stop))]
        attacks.append(threading.Thread(target=self.idle, args=(300,)))
        attacks.append(threading.Thread(target=self.malformed_flood, args=(1000,)))
        attacks.append(threading.Thread(target=self.poll, args=(range(workers, workers + 4), stop)))
        _run_all(attacks)


def _run_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_under_attack(controller: Any, attack: Callable[[Attacker, threading.Event], None]) -> tuple[Any, Attacker]:
    """Run ``controller`` (blocking) while ``attack`` runs in a thread from the moment the controller listens;
    ``attack``'s event is set when the run is over. Returns the run's result and the attacker."""
    stop = threading.Event()
    attacker = Attacker(0)

    def main() -> None:
        while not stop.wait(0.01):
            if controller.port:
                attacker.port = controller.port
                attack(attacker, stop)
                return

    thread = threading.Thread(target=main)
    thread.start()
    try:
        result = controller.run()
    finally:
        stop.set()
        thread.join()
    return result, attacker
