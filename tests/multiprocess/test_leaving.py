"""The worker's half of a clean departure (``runtime/cluster/worker/leaving.py``) alone, without JAX: a real process
with a real ``ControllerLink`` to a stand-in controller on loopback, and a real SIGTERM. It sends ``Leaving`` and
exits as the controller's ``Stop`` says; with no Stop within its grace period it exits on its own, with the code
the signal would have ended it with (143). The whole run is ``test_worker_sigterm.py``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from elastic_runtime.cluster import auth
from elastic_runtime.cluster.protocol import Hello, Leaving, Stop, WorkerMessage, decode_from_worker, encode

pytestmark = pytest.mark.timeout(120)

SECRET = "s" * 64

# The worker: opens the link, says hello, leaves on a signal, and exits as a Stop says (as Worker.serve does).
WORKER = """
import os, sys
from elastic_runtime.cluster.protocol import Hello, Stop
from elastic_runtime.cluster.worker.leaving import leave_on_signal
from elastic_runtime.cluster.worker.link import ControllerLink

link = ControllerLink(sys.argv[1], sys.argv[2])
link.send(Hello(worker=7, pid=os.getpid(), target_steps=10))
leave_on_signal(link, 7, float(sys.argv[3]))
print("ready", flush=True)
while True:
    message = link.inbox.get()
    if isinstance(message, Stop):
        os._exit(message.exit_code)
"""


class StandIn:
    """A controller that proves the secret, then records what the worker says; ``answer`` sends it a Stop."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.received: list[WorkerMessage] = []
        self.leaving = threading.Event()
        self.conn: socket.socket | None = None
        self.reader = threading.Thread(target=self._serve, daemon=True)
        self.reader.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        self.conn = conn
        lines = conn.makefile("rb")
        sent = auth.challenge()
        conn.sendall(auth.encode(sent))
        conn.sendall(auth.encode(auth.welcome(SECRET, sent, lines.readline())))
        for line in lines:
            message = decode_from_worker(line)
            self.received.append(message)
            if isinstance(message, Leaving):
                self.leaving.set()

    def answer(self, stop: Stop) -> None:
        assert self.conn is not None
        self.conn.sendall(encode(stop))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()


@pytest.fixture
def controller() -> Iterator[StandIn]:
    stand_in = StandIn()
    yield stand_in
    stand_in.close()


def start_worker(controller: StandIn, grace_s: float) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-c", WORKER, controller.address, SECRET, str(grace_s)]
    worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"
    return worker


def test_a_signalled_worker_says_it_leaves_and_exits_0_when_the_controller_stops_it(controller: StandIn) -> None:
    worker = start_worker(controller, grace_s=300)  # the grace period only guards against a hang
    worker.send_signal(signal.SIGTERM)
    assert controller.leaving.wait(60)
    worker.send_signal(signal.SIGINT)  # a second signal changes nothing: the departure is under way
    controller.answer(Stop(reason="drained at step 13", exit_code=0, at_step=13))
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output.decode()
    controller.reader.join(60)  # every line the worker sent is read once its connection closed
    kinds = [type(m) for m in controller.received]
    assert kinds == [Hello, Leaving], kinds  # one Leaving, after the Hello
    assert controller.received[1] == Leaving(worker=7, signal="SIGTERM")


def test_a_signalled_worker_with_no_answer_exits_on_its_own_after_its_grace_period(controller: StandIn) -> None:
    worker = start_worker(controller, grace_s=0.5)
    worker.send_signal(signal.SIGINT)
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 128 + signal.SIGINT, output.decode()
    assert b"no Stop from the controller within 0.5 s of SIGINT" in output
    controller.reader.join(60)
    assert controller.leaving.is_set() and controller.received[-1] == Leaving(worker=7, signal="SIGINT")
