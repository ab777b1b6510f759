"""The controller as a service for workers on other hosts, each host a network namespace
(``elastic_runtime.testing.hosts``).

The controller (``elastic-runtime controller``, a real process in the root namespace) listens on the
bridge's address with a secret from a token file; one worker x 2 CPU devices per simulated host, started
by the test as a cluster would start them. A host is lost mid-run: its link goes down, every process on it
is killed, the link removed, so only the missing heartbeats can tell the controller. The survivors re-form
without it; then a replacement on a fresh host says hello with a new id and the group grows back; the final
state matches the fault-free run (1e-5 relative: some steps ran on a data axis of 2, not 3).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
from launch_support import NPROCS, STEPS  # as the fault-free `reference` run (conftest.py) has
from test_auth import against
from test_launcher_recovery import assert_no_committed_step_lost, final_state

from elastic_runtime.cli.launch import DEFAULTS
from elastic_runtime.cluster.config import LaunchConfig, LaunchError
from elastic_runtime.cluster.controller import Controller
from elastic_runtime.cluster.controller.coordination import free_port
from elastic_runtime.cluster.protocol import Form, Heartbeat, Hello, Joined, RestoreStep, Stop
from elastic_runtime.cluster.worker import ControllerLink
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import ConnectionRefused, GroupFormed, ReplicaSkipped, StepCompleted, WorkerLost
from elastic_runtime.defaults import default_controller
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.replicas import replica
from elastic_runtime.testing.hosts import SimulatedHosts

pytestmark = pytest.mark.timeout(150)

_WAIT_S = 90.0  # a bound on each wait below, so that a broken run fails instead of hanging


def wait_for(what: str, condition: Callable[[], bool], controller: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():
        assert controller.poll() is None, f"the controller exited ({controller.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {_WAIT_S} s"
        time.sleep(0.05)


def events(run_dir: Path) -> list[Any]:
    path = run_dir / "events.jsonl"
    return read_events(path) if path.exists() else []


@dataclass
class ServiceRun:
    """A run of the controller as a service on simulated hosts, as a cluster would start it."""

    controller: subprocess.Popen[bytes]
    address: str  # the controller's host:port on the bridge
    run_dir: Path
    secret: str
    env: dict[str, str]  # the environment without the worker's own variables (the attacker's too)
    worker_env: dict[str, str]  # what a cluster gives each worker, but its id
    worker: list[str]  # the worker command


@contextlib.contextmanager
def service_run(
    hosts: SimulatedHosts,
    tmp_path: Path,
    *,
    step_delay_s: float,
    min_nprocs: int | None = None,
    replica_dirs: Path | None = None,
    nprocs: int = NPROCS,
    file_every: int | None = None,
) -> Iterator[ServiceRun]:
    """Start ``elastic-runtime controller`` in the root namespace (secret from a token file) and one worker on
    each of the first ``nprocs`` hosts; the controller is killed on the way out if it still runs. With
    ``replica_dirs`` host K's workers keep their replica files in ``replica_dirs/hostK`` (a folder that
    outlives them, as a host's disk would), not in their own ``/dev/shm``; ``file_every``: the controller's
    ``--replica-file-every``."""
    secret = os.urandom(32).hex()
    token = tmp_path / "token"
    token.write_text(secret)
    token.chmod(0o600)
    run_dir = tmp_path / "run"
    address = f"{hosts.controller_address}:{free_port(hosts.controller_address)}"
    low = free_port(hosts.controller_address)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env["ELASTIC_RUNTIME_TOKEN_FILE"] = str(token)
    command = [sys.executable, "-m", "elastic_runtime.cli", "controller", "--listen", address]
    command += ["--nprocs", str(nprocs), "--steps", str(STEPS)]
    command += [] if min_nprocs is None else ["--min-nprocs", str(min_nprocs)]
    command += [] if file_every is None else ["--replica-file-every", str(file_every)]
    command += ["--run-dir", str(run_dir), "--coordinator-ports", f"{low}-{low + 20}"]
    with open(tmp_path / "controller.log", "wb") as log:
        controller = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log)
    try:
        # What a cluster gives each worker: the controller's address, a worker id, the secret (a file).
        worker_env = env | {
            "ELASTIC_CONTROLLER": address,
            "ELASTIC_RESULT": str(tmp_path / "final"),  # process 0 commits the final state there
            "ELASTIC_STEP_DELAY_S": str(step_delay_s),  # room for what the test does while the run trains
            "ELASTIC_COMPILE_CACHE": str(tmp_path / "xla-cache"),
        }
        worker = [sys.executable, "-m", "elastic_runtime.cli.demo_multiprocess", "--worker", "--steps", str(STEPS)]
        for k in range(nprocs):
            env_k = worker_env | {"ELASTIC_WORKER_ID": str(k)}
            if replica_dirs is not None:
                env_k["ELASTIC_REPLICA_DIR"] = str(replica_dirs / f"host{k}")
            hosts.start(k, worker, env_k, tmp_path / f"worker-{k}.log")
        yield ServiceRun(controller, address, run_dir, secret, env, worker_env, worker)
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()


@pytest.mark.heavy
@pytest.mark.parametrize("fault", ["lose", "partition"])
def test_a_lost_host_is_detected_by_heartbeat_and_its_replacement_joins(
    tmp_path: Path, reference: Path, fault: str
) -> None:
    # "partition": host 1's link goes down and comes back after the survivors re-formed; its worker, alive
    # all along, is never taken back, and is told to exit when its heartbeats reach the controller again.
    # Steps of 0.6 s: the replacement must start (import JAX) and join within the run's last 25 steps; at
    # 0.3 s (7.5 s) it did not on a machine at load 10-16, and the run ended before the group grew back.
    with (
        SimulatedHosts(NPROCS + 1) as hosts,  # the last host is the replacement's, empty until then
        service_run(hosts, tmp_path, step_delay_s=0.6, min_nprocs=NPROCS - 1) as run,
    ):
        controller, run_dir, worker_env, worker = run.controller, run.run_dir, run.worker_env, run.worker

        def committed(step: int) -> bool:
            return any(isinstance(e, StepCompleted) and e.step >= step for e in events(run_dir))

        def regrouped() -> bool:
            return any(isinstance(e, GroupFormed) and e.generation == 2 for e in events(run_dir))

        wait_for("step 5", lambda: committed(5), controller)
        lost_at = time.monotonic()  # the events' mono_time is the same clock (CLOCK_MONOTONIC, one machine)
        hosts.lose(1) if fault == "lose" else hosts.partition(1)
        # The survivors go on without it (min_nprocs) rather than wait for a replacement.
        wait_for("the survivors' group", regrouped, controller)
        if fault == "partition":
            hosts.heal(1)
        # The orchestrator's replacement: a new process on a new host with nothing in its /dev/shm, a new id.
        replacement = worker_env | {"ELASTIC_WORKER_ID": str(NPROCS)}
        hosts.start(NPROCS, worker, replacement, tmp_path / f"worker-{NPROCS}.log")
        out, _ = controller.communicate(timeout=_WAIT_S)
        deadline = time.monotonic() + _WAIT_S
        while hosts.pids(1):  # the partitioned worker ends too (told to exit, or its connection closed)
            assert time.monotonic() < deadline, f"host 1 still runs {hosts.pids(1)} after the run ended"
            time.sleep(0.1)
    log_text = (tmp_path / "controller.log").read_text()
    assert controller.returncode == 0, log_text
    result = json.loads(out.decode().strip().splitlines()[-1])
    history = read_events(run_dir / "events.jsonl")

    assert result["ok"] and result["step"] == STEPS
    [lost] = [e for e in history if isinstance(e, WorkerLost)]
    assert lost.worker == 1 and lost.message.startswith("no heartbeat for "), lost  # not a closed connection
    assert lost.silent_s >= DEFAULTS["heartbeat_timeout_s"]  # the default timeout of a training worker
    assert result["strategies"] == ["start", "reform", "grow"]
    assert result["world_size_history"] == [NPROCS, NPROCS - 1, NPROCS]
    assert result["survivor_restarts"] == 0
    formed = [set(e.members) for e in history if isinstance(e, GroupFormed)]  # in the order they said hello
    assert formed == [{0, 1, 2}, {0, 2}, {0, 2, 3}]
    assert not [e for e in history if isinstance(e, ConnectionRefused)]
    assert_no_committed_step_lost(history)
    match = compare_states(final_state(tmp_path / "final"), final_state(reference), bitwise=False)
    assert match["match"], match
    # Figures, printed (not asserted: this machine's load decides them); `pytest -s` shows them.
    before = max(e.step for e in history if isinstance(e, StepCompleted) and e.mono_time < lost_at)
    [next_commit] = [e for e in history if isinstance(e, StepCompleted) and e.step == before + 1]
    figures = {
        "detected_after_s": round(lost.mono_time - lost_at, 3),
        "next_commit_after_s": round(next_commit.mono_time - lost_at, 3),
        "max_rel_error": match["max_rel_error"],
    }
    if fault == "partition":
        # Cut off, its lease ran out: it stopped (its step was blocked in a collective anyway: its peers left).
        assert "no lease from the controller" in (tmp_path / "worker-1.log").read_text()
    told = "was judged lost and is back; told to exit" in log_text
    print(f"\n{fault} host: {json.dumps(figures | {'told_to_exit': told})}")


def test_a_worker_cut_off_from_the_controller_alone_stops_in_its_lease_and_its_late_write_is_never_restored(
    tmp_path: Path, reference: Path
) -> None:
    # Only the path between host 1 and the controller is cut: host 1's worker still reaches its peers, so
    # nothing but its lease stops it (its peers would go on stepping with it). It must stop within its lease;
    # the survivors re-form without it; a replica written as by it after its fence (injected: the lease
    # already keeps it from writing) is found by its replacement on the same host and never restored; once
    # the path is back it is told to exit; each step is committed once; the result is the fault-free run's.
    replicas = tmp_path / "replicas"
    lease_s = DEFAULTS["heartbeat_timeout_s"] * 0.75  # --heartbeat-timeout's default x the controller's lease share
    with (
        SimulatedHosts(NPROCS) as hosts,
        # A file of every step: the cut-off worker's own newest file, read at step 5, is copied for its late write.
        service_run(
            hosts, tmp_path, step_delay_s=0.5, min_nprocs=NPROCS - 1, replica_dirs=replicas, file_every=1
        ) as run,
    ):
        controller, run_dir, worker_env, worker = run.controller, run.run_dir, run.worker_env, run.worker

        def formed(generation: int) -> list[GroupFormed]:
            return [e for e in events(run_dir) if isinstance(e, GroupFormed) and e.generation == generation]

        wait_for(
            "step 5", lambda: any(isinstance(e, StepCompleted) and e.step >= 5 for e in events(run_dir)), controller
        )
        cut_wall, cut_at = time.time(), time.monotonic()
        hosts.cut_from_controller(1)
        wait_for("the survivors' group", lambda: bool(formed(2)), controller)
        # The path comes back only once it stopped at a step boundary for want of a lease: the survivors, loading
        # the programs they prepared for the smaller group, may re-form while its step is still running.
        stopped = tmp_path / "worker-1.log"
        wait_for("worker 1 stopping for want of a lease", lambda: "stopped stepping" in stopped.read_text(), controller)
        fence = formed(2)[0].restore_step  # generation 1's history ends there
        # What the cut-off worker might write late, as its own: a replica of generation 1 past its fence, newer
        # than anything the survivors will hold when its host's replacement reads the host's folder.
        late_step = STEPS - 2
        own = DiskTier(replicas / "host1" / "worker-1", name="shm", check_space=False)
        own_steps = own.steps(timeout=30)
        newest_own = own.restore(max(own_steps), None, timeout=30)
        assert newest_own.metadata["generation"] == "1"
        late = replica(late_step, late_step, newest_own.tree, newest_own.metadata)
        own.save(late, timeout=30)
        hosts.reconnect(1)
        deadline = time.monotonic() + _WAIT_S
        while hosts.pids(1):  # its heartbeats reach the controller again: told to exit
            assert time.monotonic() < deadline, f"host 1 still runs {hosts.pids(1)} after the path came back"
            assert controller.poll() is None, "the controller exited"
            time.sleep(0.1)
        # The orchestrator's replacement on the same host, with a new id; it reads the host's replica folder.
        env = worker_env | {"ELASTIC_WORKER_ID": str(NPROCS), "ELASTIC_REPLICA_DIR": str(replicas / "host1")}
        hosts.start(1, worker, env, tmp_path / f"worker-{NPROCS}.log")
        out, _ = controller.communicate(timeout=_WAIT_S)
    log_text = (tmp_path / "controller.log").read_text()
    assert controller.returncode == 0, log_text
    result = json.loads(out.decode().strip().splitlines()[-1])
    history = read_events(run_dir / "events.jsonl")

    assert result["ok"] and result["step"] == STEPS
    [lost] = [e for e in history if isinstance(e, WorkerLost)]
    assert lost.worker == 1 and lost.message.startswith("no heartbeat for "), lost
    assert result["strategies"] == ["start", "reform", "grow"], result
    assert [set(e.members) for e in history if isinstance(e, GroupFormed)] == [{0, 1, 2}, {0, 2}, {0, 2, NPROCS}]
    assert "worker 1 was judged lost and is back; told to exit" in log_text
    # It started no step after its lease ran out and wrote no replica of its own past the group's history. A
    # step it started within its lease runs to its end (its collectives may be done): when the lease lapsed
    # during it, it may end one past the fence, its replica unwritten (the survivors abandoned that step).
    worker_log = (tmp_path / "worker-1.log").read_text().splitlines()
    stops = [line for line in worker_log if "stopped stepping" in line]
    assert stops, "worker 1 never stopped for want of a lease"
    stopped_step = int(stops[0].rsplit(" ", 1)[-1])
    stopped_wall = datetime.strptime(stops[0][:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    # Lapses after the cut (one before it is a lease renewed late on a loaded machine, which the worker survives).
    lapsed_in = [
        int(line.rsplit(" ", 1)[-1])
        for line in worker_log
        if "no lease from the controller during" in line
        and datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() >= cut_wall
    ]
    assert max(own_steps) <= min(stopped_step, fence), (own_steps, stopped_step, fence)
    assert stopped_step <= fence or lapsed_in[:1] == [stopped_step] == [fence + 1], (stopped_step, fence, lapsed_in)
    # Its late write was found and refused, and the fences are in the run folder.
    skipped = [e for e in history if isinstance(e, ReplicaSkipped)]
    assert [e.reason for e in skipped] == [f"written by generation 1 after it was fenced at step {fence}"], skipped
    assert str(own.path_of(late_step)) == skipped[0].path
    assert json.loads((run_dir / "run.json").read_text())["fences"]["1"] == fence
    # Each step committed once, never run again, and the same result as without the cut.
    committed = [e.step for e in history if isinstance(e, StepCompleted)]
    assert committed == list(range(1, STEPS + 1)), committed
    assert_no_committed_step_lost(history)
    match = compare_states(final_state(tmp_path / "final"), final_state(reference), bitwise=False)
    assert match["match"], match
    next_commit = min(e.mono_time for e in history if isinstance(e, StepCompleted) and e.step > fence)
    figures = {
        "stopped_after_s": round(stopped_wall - cut_wall, 3),
        "detected_after_s": round(lost.mono_time - cut_at, 3),
        "next_commit_after_s": round(next_commit - cut_at, 3),
        "fence": fence,
        "max_rel_error": match["max_rel_error"],
    }
    print(f"\ncut from the controller: {json.dumps(figures)}")
    # Its log's clock is this machine's: the lease ran out within lease_s of the cut, plus the step then running.
    assert stopped_wall - cut_wall < lease_s + 2.0, figures


def test_a_service_takes_any_new_id_once_and_never_again(tmp_path: Path) -> None:
    # A real controller in service mode, on loopback, with stand-in workers: handshakes and Hellos only.
    config = LaunchConfig(command=[], nprocs=2, run_dir=str(tmp_path), secret="s3cret", target_steps=5)
    controller = default_controller(config)
    controller.server.limiter.interval_s = 3600.0  # one summary at the end: the last reason is kept

    def hello(port: int, worker: int, target_steps: int = 5) -> ControllerLink:
        link = ControllerLink(f"127.0.0.1:{port}", "s3cret")
        link.send(Hello(worker=worker, pid=12345, target_steps=target_steps))  # a pid on another host: unchecked
        return link

    def refused(link: ControllerLink) -> None:
        message = link.inbox.get(timeout=10)
        assert isinstance(message, Stop) and "closed" in message.reason, message
        link.close()

    def attack(port: int) -> None:
        first = hello(port, 7)  # any id: a replacement's, say
        refused(hello(port, 7))  # a second Hello for a live id
        refused(hello(port, 3, target_steps=1))  # a target other than the run's
        refused(hello(port, -1))
        first.close()
        deadline = time.monotonic() + 10
        while not controller.pool[7].closed:
            assert time.monotonic() < deadline, "the controller did not see worker 7's connection close"
            time.sleep(0.01)
        refused(hello(port, 7))  # ids are never reused, not even a lost worker's
        taken = hello(port, 0)
        while 0 not in controller.pool.procs or controller.pool[0].hello is None:
            assert time.monotonic() < deadline, "worker 0's Hello was not taken"
            time.sleep(0.01)
        assert taken.inbox.empty()  # nothing yet: the group waits for a second worker (nprocs=2)
        taken.close()

    anyio.run(against, controller, attack)
    refusals = [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, ConnectionRefused)]
    assert "already connected" in refusals[0].reason
    assert "already connected or was lost" in refusals[-1].reason and sum(e.count for e in refusals) == 4
    assert sorted(controller.pool.procs) == [0, 7]


def test_a_step_is_counted_once_and_an_old_generation_s_heartbeats_count_for_nothing(tmp_path: Path) -> None:
    # A real controller in service mode, on loopback, with two stand-in workers that speak the protocol but
    # train nothing. Worker 1 goes silent after step 3 (cut off); worker 0 goes on alone in generation 2.
    # Then both send heartbeats of generation 1 with steps far ahead (a cut-off worker that still reached its
    # peers, and a survivor's late one): none of it may count; generation 2 counts from step 3 on.
    config = LaunchConfig(
        command=[],
        nprocs=2,
        min_nprocs=1,
        run_dir=str(tmp_path),
        secret="s3cret",
        target_steps=20,
        heartbeat_timeout_s=1.0,
        hang_timeout_s=60.0,
    )
    controller = default_controller(config)
    beats: dict[int, tuple[int, int] | None] = {0: None, 1: None}  # worker -> (generation, step) it reports
    done = threading.Event()

    def expect(link: ControllerLink, kind: type[Any], generation: int | None = None) -> Any:
        deadline = time.monotonic() + 20
        while True:
            message = link.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(message, kind) and getattr(message, "generation", generation) == generation:
                return message

    def beat(links: dict[int, ControllerLink]) -> None:
        while not done.is_set():
            for worker, link in links.items():
                state = beats[worker]
                if state is not None:
                    gen, step = state
                    link.send(Heartbeat(worker=worker, generation=gen, step=step, sent_at=time.time()))
            time.sleep(0.1)

    def until(what: str, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 20
        while not condition():
            assert time.monotonic() < deadline, f"no {what} within 20 s"
            time.sleep(0.01)

    def run(port: int) -> None:
        links = {w: ControllerLink(f"127.0.0.1:{port}", "s3cret") for w in (0, 1)}
        for worker, link in links.items():
            link.send(Hello(worker=worker, pid=12345, target_steps=20))
        threading.Thread(target=beat, args=(links,), daemon=True).start()
        try:
            for worker, link in links.items():
                expect(link, Form, 1)
                link.send(Joined(worker=worker, generation=1, best_step=0, tier="none", join_s=0.0))
            for worker, link in links.items():
                expect(link, RestoreStep, 1)
                beats[worker] = (1, 3)
            until("step 3", lambda: controller.group_step == 3)
            beats[1] = None  # cut off: the controller hears nothing more from worker 1
            form = expect(links[0], Form, 2)
            assert form.num_processes == 1 and form.fences == {}  # generation 1 not fenced before its restore
            beats[0] = (2, 3)
            links[0].send(Joined(worker=0, generation=2, best_step=3, tier="ram", join_s=0.0))
            assert expect(links[0], RestoreStep, 2).step == 3
            assert controller.group.fences == {1: 3}
            assert json.loads((tmp_path / "run.json").read_text())["fences"] == {"1": 3}  # before anything steps
            # Generation 1, late: worker 1 (judged lost) says step 9, the survivor's old self says step 6.
            links[1].send(Heartbeat(worker=1, generation=1, step=9, sent_at=time.time()))
            links[0].send(Heartbeat(worker=0, generation=1, step=6, sent_at=time.time()))
            assert "worker 1 was judged lost" in expect(links[1], Stop).reason
            time.sleep(0.3)  # room for the controller to (wrongly) count them
            assert controller.group_step == 3
            beats[0] = (2, 4)
            until("step 4", lambda: controller.group_step == 4)
            time.sleep(0.3)
            assert controller.group_step == 4
        finally:
            done.set()
            for link in links.values():
                link.close()

    anyio.run(against, controller, run)
    committed = [e.step for e in read_events(tmp_path / "events.jsonl") if isinstance(e, StepCompleted)]
    assert committed == [1, 2, 3, 4]  # each once, none of generation 1's late claims


def test_a_service_needs_a_secret_from_the_user() -> None:
    with pytest.raises(LaunchError, match=r"refusing to listen on 198\.18\.0\.1 without a secret"):
        Controller(LaunchConfig(command=["true"], nprocs=1, listen_host="198.18.0.1"))
    with pytest.raises(LaunchError, match="must prove a secret they know"):
        Controller(LaunchConfig(command=[], nprocs=1))


def test_the_controller_refuses_a_reachable_address_without_a_secret(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    command = [sys.executable, "-m", "elastic_runtime.cli", "controller", "--listen", "198.18.0.1:0", "--nprocs", "2"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1
    assert "refusing to listen on 198.18.0.1 without a secret" in done.stderr, done.stderr
