"""A worker's exit code tells a cluster scheduler whether to replace it: 0 when the run is over, EXIT_REPLACE when
the run goes on without it (its place taken, or its controller gone). A Kubernetes Job counts a pod that exits 0
as its index done and never replaces it (examples/kubernetes/), and the SLURM script (examples/slurm/) replaces
only a task that failed.

A real socket and the real handshake: a one-connection controller on loopback that proves the secret, reads the
worker's Hello and then says stop, or closes the connection.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from elastic_runtime.cluster import auth
from elastic_runtime.cluster.protocol import (
    ENV_CONTROLLER,
    ENV_HEARTBEAT_S,
    ENV_WORKER,
    EXIT_REPLACE,
    Hello,
    Stop,
    decode_from_controller,
    decode_from_worker,
    encode,
)
from elastic_runtime.cluster.worker import ControllerLink, Worker
from elastic_runtime.cluster.worker.settings import WorkerSettings
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.storage.replicas import ReplicaFiles
from elastic_runtime.testing.demo_model import demo_job

SECRET = auth.new_secret()


@contextmanager
def controller(then: Callable[[socket.socket], None]) -> Iterator[str]:
    """A controller for one worker: handshake, the Hello, then ``then(connection)``; yields its address."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    failures: list[BaseException] = []

    def serve() -> None:
        try:
            conn, _ = server.accept()
            with conn, conn.makefile("rb") as lines:
                sent = auth.challenge()
                conn.sendall(auth.encode(sent))
                conn.sendall(auth.encode(auth.welcome(SECRET, sent, lines.readline())))
                assert isinstance(decode_from_worker(lines.readline()), Hello)
                then(conn)
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        thread.join(10)
        server.close()
    assert not failures, failures


def serve_worker(address: str, tmp_path: Path) -> int:
    link = ControllerLink(address, SECRET, timeout=10)
    # The worker's heartbeat thread runs until its process exits; here the process is pytest's. One heartbeat,
    # then it sleeps, rather than send to a closed socket every 0.2 s for the rest of the session.
    settings = WorkerSettings.from_env({ENV_CONTROLLER: address, ENV_WORKER: "0", ENV_HEARTBEAT_S: "3600"})
    try:
        job = demo_job(global_batch=8, features=8, hidden=8)
        return Worker(job, 5, settings=settings, link=link, replicas=ReplicaFiles(tmp_path, "worker-0")).serve()
    finally:
        link.close()


@pytest.mark.parametrize(
    ("stop", "code"),
    [
        (Stop(reason="the run is over"), 0),
        (Stop(reason="worker 0 was judged lost; its place is taken", exit_code=EXIT_REPLACE), EXIT_REPLACE),
    ],
)
def test_the_exit_code_is_the_stop_messages(stop: Stop, code: int, tmp_path: Path) -> None:
    with controller(lambda conn: conn.sendall(encode(stop))) as address:
        assert serve_worker(address, tmp_path) == code


def test_a_worker_whose_controller_is_gone_asks_to_be_replaced(tmp_path: Path) -> None:
    with controller(lambda conn: conn.shutdown(socket.SHUT_RDWR)) as address:
        assert serve_worker(address, tmp_path) == EXIT_REPLACE


def test_a_stop_without_a_code_is_the_end_of_the_run() -> None:
    # A controller of the previous version sends no exit_code: its Stop still decodes, as the end of the run.
    assert decode_from_controller(b'{"type":"Stop","reason":"the run is over"}\n') == Stop(reason="the run is over")


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({ENV_CONTROLLER: "127.0.0.1:1"}, "ELASTIC_WORKER_ID is not set"),
        ({ENV_CONTROLLER: "127.0.0.1:1", ENV_WORKER: "three"}, "ELASTIC_WORKER_ID='three'"),
        ({ENV_CONTROLLER: "127.0.0.1:1", ENV_WORKER: "1", ENV_HEARTBEAT_S: "0"}, "ELASTIC_HEARTBEAT_S='0'"),
    ],
)
def test_a_bad_worker_environment_names_the_variable(environ: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        WorkerSettings.from_env(environ)


def test_the_worker_environment_is_read_once_with_its_defaults() -> None:
    settings = WorkerSettings.from_env({ENV_CONTROLLER: "127.0.0.1:1", ENV_WORKER: "4", ENV_HEARTBEAT_S: "0.5"})
    assert (settings.worker, settings.heartbeat_s, settings.local_devices, settings.jax_shutdown_s) == (4, 0.5, 2, 2)
    assert settings.replica_folder(123) == "/dev/shm/elastic-runtime-123"
