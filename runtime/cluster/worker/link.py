"""The worker's connection to the controller: the authenticated link, its reader thread and inbox, and
connecting while the controller is not up yet."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

from elastic_runtime.cluster import auth
from elastic_runtime.cluster.protocol import (
    EXIT_REPLACE,
    DurableCommitted,
    Form,
    Lease,
    MalformedMessage,
    Message,
    Notify,
    RestoreStep,
    Stop,
    Warm,
    decode_from_controller,
    encode,
)

log = logging.getLogger(__name__)


Inbound = Form | RestoreStep | Warm | Stop

# Handshakes the controller may close before a worker gives up (see ``connect``).
_HANDSHAKE_TRIES = 5


class ControllerLink:
    """The connection to the controller: a lock-protected sender and a reader thread feeding ``inbox``.

    Opening it proves ``secret`` to the controller and checks the controller's proof of it in turn.

    Raises:
        AuthenticationFailed: either side's proof of the secret was refused.
        OSError: the controller cannot be reached (or did not answer within ``timeout``).
    """

    def __init__(self, address: str, secret: str, timeout: float = 30.0) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self._lines = self.sock.makefile("rb")
        try:
            answer, expected = auth.answer(secret, self._lines.readline(auth.MAX_LINE))
            self.sock.sendall(auth.encode(answer))
            auth.check_welcome(expected, self._lines.readline(auth.MAX_LINE))
        except BaseException:
            self._lines.close()
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inbox: queue.Queue[Inbound] = queue.Queue()
        # Set at each message put in ``inbox`` and each lease: wakes the main thread's waits (stepping.py), which
        # clear it before they look.
        self.arrived = threading.Event()
        # Monotonic time the controller's lease runs out; no lease until the first one (launch mode has none).
        self.lease_until = float("inf")
        self.form_arrived = 0.0  # monotonic time the newest Form came in (its wait until the join is timed)
        # Called (in the reader thread) with each durable step the controller committed.
        self.on_committed: Callable[[int], None] = lambda step: None
        # Called (in the reader thread) with each of the group's events for the script's handlers.
        self.on_notify: Callable[[Notify], None] = lambda notify: None
        # Set at the first Stop the controller sends: from then on the controller has the worker's exit in hand
        # (runtime/cluster/worker/leaving.py waits for it).
        self.stop_heard = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="controller-reader", daemon=True).start()

    def send(self, message: Message) -> None:
        data = encode(message)
        with self._lock:
            try:
                self.sock.sendall(data)
            except OSError as exc:
                log.error("lost the controller connection while sending: %s", exc)
                self._deliver(Stop(reason=f"controller connection lost: {exc}", exit_code=EXIT_REPLACE))

    def leased(self) -> bool:
        """Whether the controller still counts on this worker (its last lease has not run out)."""
        return time.monotonic() < self.lease_until

    def close(self) -> None:
        """Close the connection; the reader thread then puts a Stop in ``inbox``."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # ends the reader's loop, which then closes its file
        self.sock.close()

    def _read(self) -> None:
        with self._lines, contextlib.suppress(OSError):
            for line in self._lines:
                try:
                    message = decode_from_controller(line)
                except MalformedMessage as exc:
                    log.error("malformed message from the controller ignored: %s", exc)
                    continue
                if isinstance(message, Lease):
                    self.lease_until = time.monotonic() + message.seconds
                    self.arrived.set()  # a worker that stopped stepping for want of one goes on
                elif isinstance(message, DurableCommitted):
                    self.on_committed(message.step)
                elif isinstance(message, Notify):
                    self.on_notify(message)
                else:
                    if isinstance(message, Form):
                        self.form_arrived = time.monotonic()
                    elif isinstance(message, Stop):
                        self.stop_heard.set()
                    self._deliver(message)
        # Without a controller there is nobody to re-form the group: stop rather than train alone.
        self._deliver(Stop(reason="controller connection closed", exit_code=EXIT_REPLACE))

    def _deliver(self, message: Inbound) -> None:
        self.inbox.put(message)
        self.arrived.set()


def connect(address: str, secret: str, timeout_s: float) -> ControllerLink:
    """Open the link to the controller, trying again for ``timeout_s`` while nothing listens there yet: a
    cluster starts the workers and the controller in any order (a worker ``launch`` starts finds it up).

    A handshake the controller closes is tried again a few times: under a flood of connections the controller
    closes the oldest waiting handshakes to make room, which may be ours. With a wrong secret every try ends
    the same way, and the last one's error is raised.

    Raises:
        AuthenticationFailed: a proof was refused (after the retries above), or the controller's was wrong.
        OSError: the controller could not be reached within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    closed = 0
    while True:
        try:
            return ControllerLink(address, secret)
        except auth.ClosedDuringHandshake as exc:
            closed += 1
            if closed >= _HANDSHAKE_TRIES or time.monotonic() > deadline:
                raise
            log.info("controller %s closed our handshake (%s); trying again", address, exc)
            time.sleep(0.2 * closed)
        except OSError as exc:  # not AuthenticationFailed: a refused proof is final
            if time.monotonic() > deadline:
                raise
            log.info("controller %s not reachable yet (%s); trying again", address, exc)
            time.sleep(0.5)
