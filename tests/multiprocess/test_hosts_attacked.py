"""Bad input on the controller's port from another simulated host, during a real run (issue 18).

The setup of ``test_hosts.py`` without a fault: the controller as a service in the root namespace, 3 hosts x
1 worker. Once the run has committed a few steps, a process on a fourth host (``attacker_main.py``), which
does not know the secret, tries each kind of bad input over the bridge, each from an address of its own, so
that the controller's rate-limited events can be told apart by host: garbage bytes, a 10 MB line, well-formed
protocol messages without the handshake, a replayed proof, Hellos claiming the running workers' ids, 300
connections at once. The run must end as the fault-free one does, bitwise; every connection the attacker
opened must be counted in a ``ConnectionRefused`` event; the attacker must never have received anything but
the handshake's ``Challenge``.

The replayed proof is a real one: the test, which holds the secret, makes one handshake as a worker would and
records its ``Answer`` line (what anyone on the path would see of a worker's handshake), and the attacker sends
that line again on new connections. It proves the secret, but for the nonce of the connection it was made
on, so the controller refuses it as a wrong proof.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest
from launch_support import NPROCS, STEPS  # as the fault-free `reference` run (conftest.py) has
from test_hosts import events, service_run, wait_for
from test_launcher_recovery import final_state

from elastic_runtime.cluster import auth
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import ConnectionRefused, MalformedHeartbeat, StepCompleted, WorkerLost
from elastic_runtime.testing.hosts import SimulatedHosts

# The refusal each kind's first event names (the first of each host is reported at once, with its reason).
KINDS = {
    "garbage": ("expected Answer", "a handshake line longer than"),
    "10 MB line": ("a handshake line longer than 512 bytes",),
    "no proof": ("expected Answer",),
    "replayed proof": ("wrong proof of the secret",),
    "existing id": ("expected Answer",),  # the impostor Hello comes first
    "connections": ("over 32 connections waiting",),
}


def record_answer(address: str, secret: str) -> bytes:
    """One real handshake with the controller, as a worker makes it; the ``Answer`` line it sent."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock, sock.makefile("rb") as lines:
        sent, expected = auth.answer(secret, lines.readline())
        line = auth.encode(sent)
        sock.sendall(line)
        auth.check_welcome(expected, lines.readline())  # accepted; closed before any Hello: no event
    return line


@pytest.mark.timeout(150)
def test_bad_input_from_another_host_is_refused_and_training_is_unaffected(tmp_path: Path, reference: Path) -> None:
    # The last host is the attacker's; the steps are slowed to leave room for every attack while the run trains.
    with SimulatedHosts(NPROCS + 1) as hosts, service_run(hosts, tmp_path, step_delay_s=0.5) as run:
        controller, run_dir, address = run.controller, run.run_dir, run.address
        sources = {kind: hosts.add_address(NPROCS) for kind in KINDS}

        def committed(step: int) -> bool:
            return any(isinstance(e, StepCompleted) and e.step >= step for e in events(run_dir))

        wait_for("step 3", lambda: committed(3), controller)
        answer = record_answer(address, run.secret)
        attack = [sys.executable, str(Path(__file__).with_name("attacker_main.py")), address, answer.hex()]
        attack += [f"{kind}={source}" for kind, source in sources.items()]
        started = time.monotonic()
        attacker = hosts.start(NPROCS, attack, run.env, tmp_path / "attacker.log")
        assert attacker.wait(timeout=60) == 0, (tmp_path / "attacker.log").read_text()
        attack_s = time.monotonic() - started
        assert controller.poll() is None, "the run ended before the attacks did"
        out, _ = controller.communicate(timeout=90)
    log_text = (tmp_path / "controller.log").read_text()
    assert controller.returncode == 0, log_text
    result = json.loads(out.decode().strip().splitlines()[-1])
    report = json.loads((tmp_path / "attacker.log").read_text().strip().splitlines()[-1])
    history = read_events(run_dir / "events.jsonl")

    # Training went on unaffected: the fault-free run's outcome, bitwise.
    assert result["ok"] and result["step"] == STEPS
    assert result["recoveries"] == [] and result["world_size_history"] == [NPROCS]
    assert not [e for e in history if isinstance(e, WorkerLost | MalformedHeartbeat)]
    match = compare_states(final_state(tmp_path / "final"), final_state(reference), bitwise=True)
    assert match["match"], match
    # Every attack was refused at the handshake, each connection counted once, from its own address.
    refused = [e for e in history if isinstance(e, ConnectionRefused)]
    assert {e.peer for e in refused} == set(sources.values())
    counts = {}
    for kind, source in sources.items():
        mine = [e for e in refused if e.peer == source]
        assert report[kind]["problems"] == [], (kind, report[kind]["problems"])
        assert report[kind]["connections"] > 0
        assert sum(e.count for e in mine) == report[kind]["connections"], (kind, mine)
        assert mine[0].reason.startswith(KINDS[kind]), (kind, mine[0])
        assert len(mine) <= 3  # the first at once, then summaries: not one event each
        counts[kind] = [report[kind]["connections"], report[kind]["challenges"]]
    # Not vacuous: each kind reached the handshake over the bridge (a connection may lose its challenge to the
    # reset that answers what it was still sending, so not necessarily every connection).
    assert all(challenges > 0 for _, challenges in counts.values()), counts
    print(f"\nattacked from another host, [connections, challenges received]: {json.dumps(counts)}")
    print(f"{len(refused)} ConnectionRefused events, attacks took {attack_s:.1f} s, final state bitwise equal")
