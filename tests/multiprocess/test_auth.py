"""Nobody without the run's secret can steer a launched run (issue 17): every connection to the controller's
port proves the secret before its first message is read; refusals and malformed lines are rate-limited
events; idle connections are closed; a Hello is checked against the process the controller started and the
run's own target; a spare that dies before its Hello is replaced at once.

Real sockets throughout; the attacks run in threads next to a real controller. The runs with real JAX
workers end bitwise equal to the fault-free `reference` run (conftest.py).
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import jax
import numpy as np
import pytest
from attacker import Attacker, run_under_attack
from launch_support import NPROCS, STEPS

from elastic_runtime.cli.demo_multiprocess import group_controller
from elastic_runtime.cluster import auth
from elastic_runtime.cluster.config import LaunchConfig
from elastic_runtime.cluster.controller import Controller
from elastic_runtime.cluster.controller.server import ReportLimiter
from elastic_runtime.cluster.protocol import Hello, Stop, encode
from elastic_runtime.cluster.worker import ControllerLink, connect
from elastic_runtime.core.errors import AuthenticationFailed
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import ConnectionRefused, Event, MalformedHeartbeat, WorkerExited, WorkerStarted
from elastic_runtime.defaults import default_controller
from elastic_runtime.faults.grammar import Fault
from elastic_runtime.storage.disk import DiskTier

# --- the handshake and the limiter, without processes ---------------------------------------------------


def test_the_handshake_proves_the_secret_both_ways_and_replays_nothing() -> None:
    sent = auth.challenge()
    answer, expected = auth.answer("s3cret", auth.encode(sent))
    welcome = auth.welcome("s3cret", sent, auth.encode(answer))
    auth.check_welcome(expected, auth.encode(welcome))
    assert "s3cret" not in (auth.encode(sent) + auth.encode(answer) + auth.encode(welcome)).decode()

    with pytest.raises(AuthenticationFailed, match="wrong proof"):
        auth.welcome("other", sent, auth.encode(answer))  # the peer does not know our secret
    with pytest.raises(AuthenticationFailed, match="wrong proof"):
        auth.welcome("s3cret", auth.challenge(), auth.encode(answer))  # a recorded answer, replayed
    reflected = auth.Answer(nonce=answer.nonce, proof=welcome.proof)  # the controller's proof sent back to it
    with pytest.raises(AuthenticationFailed, match="wrong proof"):
        auth.welcome("s3cret", sent, auth.encode(reflected))
    _, expected = auth.answer("s3cret", auth.encode(sent))
    with pytest.raises(AuthenticationFailed, match="not our controller"):
        auth.check_welcome(expected, auth.encode(auth.Welcome(proof="0" * 64)))  # a controller without it
    with pytest.raises(AuthenticationFailed, match="closed the connection"):
        auth.check_welcome(expected, b"")
    with pytest.raises(AuthenticationFailed, match="expected Answer"):
        auth.welcome("s3cret", sent, encode(Hello(worker=0, pid=1, target_steps=1)))


def test_a_secret_comes_from_the_environment_or_a_private_file(tmp_path: Path) -> None:
    assert auth.load_secret({}) is None
    assert auth.load_secret({auth.ENV_TOKEN: "abc"}) == "abc"
    token = tmp_path / "token"
    token.write_text("from-a-file\n")
    token.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert auth.load_secret({auth.ENV_TOKEN_FILE: str(token)}) == "from-a-file"
    token.chmod(0o644)
    with pytest.raises(AuthenticationFailed, match="other users"):
        auth.load_secret({auth.ENV_TOKEN_FILE: str(token)})
    with pytest.raises(AuthenticationFailed, match="cannot read"):
        auth.load_secret({auth.ENV_TOKEN_FILE: str(tmp_path / "missing")})
    assert len(auth.new_secret()) == 64 and auth.new_secret() != auth.new_secret()


def test_reports_are_limited_per_host_and_interval() -> None:
    now = [0.0]
    limiter = ReportLimiter(interval_s=10.0, max_sources=2, clock=lambda: now[0])
    first = limiter.note("refused", "127.0.0.1", "one")
    assert first is not None and first.count == 1
    assert all(limiter.note("refused", "127.0.0.1", f"n{i}") is None for i in range(499))
    assert limiter.note("malformed", "127.0.0.1", "bad") is not None  # another kind: its own tally
    assert limiter.due() == []  # the interval has not ended
    now[0] = 10.0
    [summary] = limiter.due()  # the malformed tally counted nothing more: no summary for it
    assert (summary.kind, summary.count, summary.reason) == ("refused", 499, "n498")
    assert limiter.note("refused", "127.0.0.1", "again") is not None  # a new interval reports at once
    # Past max_sources, new hosts share one tally instead of growing the table.
    assert limiter.note("refused", "127.0.0.2", "x") is not None
    shared = limiter.note("refused", "127.0.0.3", "y")
    assert shared is not None and shared.peer == "other hosts"
    assert limiter.note("refused", "127.0.0.4", "z") is None
    assert sum(r.count for r in limiter.due(final=True)) == 1


# --- a real controller with stand-in workers (no JAX process starts) -----------------------------------


def stand_in_controller(tmp_path: Path, **overrides: Any) -> Controller:
    # Stand-in workers that never connect, so the controller waits for them while the test talks to it.
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    values: dict[str, Any] = {"nprocs": 2, "spares": 0, "run_dir": str(tmp_path), "spawn_timeout_s": 30}
    config = LaunchConfig(command=command, **(values | overrides))
    controller = default_controller(config)
    controller.server.limiter.interval_s = 3600.0  # one summary per host, at the end: the counts are exact
    return controller


async def against(controller: Controller, attack: Any) -> None:
    """Run ``attack(port)`` in a thread while ``controller`` serves; then stop the controller."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(controller.run_async)
        with anyio.fail_after(10):
            while not controller.port:
                await anyio.sleep(0.01)
        await anyio.to_thread.run_sync(attack, controller.port)
        for proc in controller.pool:
            if proc.popen is not None:  # none for a worker it did not start (service mode)
                proc.popen.kill()  # a stand-in ignores Stop; the controller would wait for it
        tg.cancel_scope.cancel()


def events_of(tmp_path: Path, kind: type[Event]) -> list[Any]:
    return [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, kind)]


def test_without_the_secret_nothing_is_read_idle_connections_close_and_refusals_are_counted(
    tmp_path: Path,
) -> None:
    controller = stand_in_controller(tmp_path, auth_timeout_s=0.5)
    attacker = Attacker(0, timeout_s=20.0)

    def attack(port: int) -> None:
        attacker.port = port
        for worker in range(3):
            attacker.impostor_hello(worker)
            attacker.guess_proof(worker)
        attacker.malformed_flood(200)
        # 300 idle connections: the oldest beyond 32 are closed at once, the rest at the handshake deadline;
        # a worker with the secret still gets in while they are open.
        idle = threading.Thread(target=attacker.idle, args=(300,))
        idle.start()
        # As a worker connects (retrying a handshake closed for room); raises unless both proofs held.
        connect(f"127.0.0.1:{port}", controller.secret, timeout_s=20).close()
        idle.join()

    anyio.run(against, controller, attack)
    assert attacker.problems == []
    assert attacker.connections == 3 + 3 + 1 + 20 + 300
    assert not any(p.hello for p in controller.pool)  # no impostor was taken for a worker
    refused = events_of(tmp_path, ConnectionRefused)
    assert len(refused) == 2, refused  # the first refusal at once, one summary of the rest
    assert sum(e.count for e in refused) == attacker.connections == controller.server.refused


def test_malformed_lines_after_the_handshake_are_counted_not_logged_one_by_one(tmp_path: Path) -> None:
    controller = stand_in_controller(tmp_path)

    def attack(port: int) -> None:
        link = ControllerLink(f"127.0.0.1:{port}", controller.secret)
        for _ in range(150):
            link.send(Stop(reason="not a worker's message"))  # valid JSON, wrong direction
        assert isinstance(link.inbox.get(timeout=10), Stop)  # closed after MAX_MALFORMED lines
        link.close()

    anyio.run(against, controller, attack)
    malformed = events_of(tmp_path, MalformedHeartbeat)
    assert len(malformed) == 2
    assert sum(e.count for e in malformed) == 101  # 100 lines, then "connection closed"
    assert "connection closed" in malformed[-1].reason


def test_a_hello_is_checked_against_the_started_process_and_the_run_target(tmp_path: Path) -> None:
    controller = stand_in_controller(tmp_path, target_steps=5)

    def attack(port: int) -> None:
        real = controller.pool[0].popen.pid
        cases = [
            Hello(worker=4242, pid=real, target_steps=5),  # an id the controller never started
            Hello(worker=0, pid=os.getpid(), target_steps=1),  # not the process started as worker 0
        ]
        # (The started process itself asking for another target ends the run: test_launcher_budget.py.)
        for hello in cases:
            link = ControllerLink(f"127.0.0.1:{port}", controller.secret)
            link.send(hello)
            message = link.inbox.get(timeout=10)
            assert isinstance(message, Stop) and "closed" in message.reason, message
            link.close()
        accepted = ControllerLink(f"127.0.0.1:{port}", controller.secret)
        accepted.send(Hello(worker=0, pid=real, target_steps=5))
        again = ControllerLink(f"127.0.0.1:{port}", controller.secret)
        again.send(Hello(worker=0, pid=real, target_steps=5))  # worker 0 is already connected
        assert isinstance(again.inbox.get(timeout=10), Stop)
        again.close()
        assert accepted.inbox.empty()
        accepted.close()

    anyio.run(against, controller, attack)
    refusals = [e.reason for e in events_of(tmp_path, ConnectionRefused)]
    assert "was not started by this controller" in refusals[0]
    # The limiter reports the first and a summary naming the last; the controller logged each by reason.
    assert "already connected" in refusals[-1] and len(refusals) == 2
    assert controller.pool[0].hello is not None and controller.target_steps == 5


# --- real runs ------------------------------------------------------------------------------------------


def assert_same_final_state(run_dir: Path, reference: Path) -> None:
    got, want = (jax.tree.leaves(DiskTier(folder).latest(None).tree) for folder in (run_dir / "final", reference))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"leaf {i} differs from the fault-free run"


@pytest.mark.timeout(180)
def test_attacks_by_a_local_process_are_refused_and_training_is_unaffected(
    tmp_path: Path, reference: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    controller = group_controller(processes=NPROCS, steps=STEPS, run_dir=tmp_path, faults=[])
    command_lines: list[str] = []

    async def note_command_line(event: WorkerStarted, ctx: Any) -> None:  # as `ps` shows it (a fork: its server's)
        command_lines.append(Path(f"/proc/{event.pid}/cmdline").read_text(errors="replace"))

    controller.bus.subscribe(WorkerStarted, note_command_line)
    # Impostor Hello, forged Heartbeat(600) and Finished, guessed proofs with target_steps=1 for ids 0-3 (3:
    # the spare), polling ids 4-7 for the next spare's Warm all run long, 300 idle connections, a flood of
    # malformed lines: all right after launch.
    result, attacker = run_under_attack(controller, lambda attacker, stop: attacker.everything(NPROCS + 1, stop))
    assert result.ok and result.step == STEPS, result.reason
    assert attacker.problems == []
    assert attacker.connections > 300 + 2 * (NPROCS + 1)
    assert len(result.digests) >= NPROCS and len(set(result.digests.values())) == 1
    assert "forged" not in result.digests.values()
    events = read_events(tmp_path / "events.jsonl")
    refused = [e for e in events if isinstance(e, ConnectionRefused)]
    # Each attack the controller answered is refused, none twice; a connection still in the kernel's backlog
    # when the run ended (no challenge came back: 1 of 490 once, in CI) was never seen, so never refused.
    assert attacker.challenges <= sum(e.count for e in refused) <= attacker.connections
    assert len(refused) < attacker.connections / 10  # counted, not one event each
    assert_same_final_state(tmp_path, reference)
    # The secret went to the workers by their environment only: not on a command line, not in any record.
    secret = controller.secret
    assert len(command_lines) >= NPROCS + 1 and all(secret not in line for line in command_lines)
    for path in [tmp_path / "events.jsonl", tmp_path / "summary.json", *(tmp_path / "workers").iterdir()]:
        assert secret not in path.read_text(errors="replace"), path
    assert secret not in caplog.text and secret not in repr(controller.config)


@pytest.mark.timeout(180)
def test_a_spare_that_dies_before_its_hello_is_replaced_at_once(tmp_path: Path, reference: Path) -> None:
    # Worker 1 is killed at step 10; spare 3 takes its place and spare 4 is started for the next failure.
    # Spare 4 is killed as soon as it starts, long before it could say hello: its successor (5) must be
    # started then, not at the next failure (there is none).
    controller = group_controller(processes=NPROCS, steps=STEPS, run_dir=tmp_path, faults=[Fault("kill", 1, step=10)])

    async def kill_spare(event: WorkerStarted, ctx: Any) -> None:
        if event.worker == NPROCS + 1:
            os.kill(event.pid, signal.SIGKILL)

    controller.bus.subscribe(WorkerStarted, kill_spare)
    result = controller.run()
    assert result.ok and result.step == STEPS, result.reason
    events = read_events(tmp_path / "events.jsonl")
    exited = [i for i, e in enumerate(events) if isinstance(e, WorkerExited) and e.worker == NPROCS + 1]
    started = [i for i, e in enumerate(events) if isinstance(e, WorkerStarted) and e.worker == NPROCS + 2]
    assert exited and started and started[0] > exited[0]
    assert controller.pool[NPROCS + 1].hello is None  # it died before its hello, as the test means
    assert_same_final_state(tmp_path, reference)


def test_a_worker_with_a_wrong_secret_gives_up_after_a_few_closed_handshakes(tmp_path: Path) -> None:
    controller = stand_in_controller(tmp_path)

    def attack(port: int) -> None:
        # Each handshake is closed (the proof is refused); retried in case it was closed to make room, then final.
        with pytest.raises(auth.ClosedDuringHandshake):
            connect(f"127.0.0.1:{port}", "not the run's secret", timeout_s=20)

    anyio.run(against, controller, attack)
    refused = events_of(tmp_path, ConnectionRefused)
    assert sum(e.count for e in refused) == 5 and "wrong proof" in refused[0].reason
