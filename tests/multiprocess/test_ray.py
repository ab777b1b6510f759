"""Ray as the scheduler, on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``).

A head without CPUs (the driver and the controller) and NPROCS + 1 worker nodes of one CPU each, every process
on 127.0.0.1. ``launch --backend ray``'s parts place one worker actor per node; mid-run (after step 3) the
node of worker 1 is removed (its raylet and actor processes killed: the host loss). Ray reports the actor dead
before any heartbeat is missed; the survivors re-form at once, Ray places a replacement with a new id on the
free node and the group grows back; the final state matches the fault-free run (1e-5 relative: some steps ran
on a data axis of 2, not 3). The other signal: a worker's process killed while its actor lives is detected by
the controller (its connection closed), and Ray still places the replacement. ``elastic-runtime launch
--backend ray --ray-address`` runs a short fault-free job on the same cluster. Ray is a dependency of
``.[dev]``: if it cannot start, this fails; it never skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import ray  # noqa: F401 - a missing Ray fails the collection: no skip
from launch_support import NPROCS, STEPS  # as the fault-free `reference` run (conftest.py) has
from test_launcher_recovery import assert_no_committed_step_lost, final_state

from elastic_runtime.cli.demo_multiprocess import worker_command
from elastic_runtime.cli.launch import config_from_args
from elastic_runtime.cluster import auth
from elastic_runtime.cluster.config import LaunchConfig, LaunchResult
from elastic_runtime.cluster.controller.ray_cluster import local_cluster, ray_session
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.errors import ElasticRuntimeError
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupFormed, RunStarted, StepCompleted, WorkerLost, WorkerStarted
from elastic_runtime.defaults import ray_controller

# Ray starts its processes with a preexec_fn (ray/_private/services.py), which runs Python's at-fork hooks in
# this process: JAX's warns that fork and its threads may deadlock. The child execs Ray's binary at once, so
# the warning does not apply; where JAX's backend is already up (the whole suite), it must not fail the test.
pytestmark = [
    pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning"),
    pytest.mark.timeout(240),
]

_WAIT_S = 120.0  # a bound on each wait below, so that a broken run fails instead of hanging


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launch_takes_the_ray_backend_and_refuses_what_it_cannot_do() -> None:
    from elastic_runtime.cli.launch_ray import ray_config
    from elastic_runtime.cli.main import build_parser

    def config(*argv: str) -> LaunchConfig:
        args = build_parser().parse_args(["launch", "--backend", "ray", *argv, "--", "python", "train.py"])
        return ray_config(config_from_args(args), host="127.0.0.1", min_nprocs=args.min_nprocs)

    service = config("--nprocs", "4", "--result", "out")
    assert service.command == [] and not service.starts_workers  # the service mode: Ray starts the workers
    assert service.min_nprocs == 3 and service.secret and service.listen_host == "127.0.0.1"
    assert config("--nprocs", "4", "--min-nprocs", "4").min_nprocs == 4
    with pytest.raises(SystemExit, match="--fault signals local processes"):
        config("--nprocs", "2", "--fault", "kill:1@5")
    with pytest.raises(SystemExit, match="--ray-address needs --backend ray"):
        args = build_parser().parse_args(["launch", "--nprocs", "2", "--ray-address", "x:1", "--", "python"])
        args.func(args)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """The test cluster: a head without CPUs and NPROCS + 1 nodes of one CPU, all on 127.0.0.1 (~10 s)."""
    with local_cluster(NPROCS + 1) as made:
        from ray._common.usage import usage_lib

        # A test reaches no address outside the machine: Ray's usage reporting (to usage-stats.ray.io) is off.
        assert not usage_lib.usage_stats_enabled()
        yield made


def test_launch_runs_on_a_ray_cluster_at_an_address(cluster: Any, tmp_path: Path) -> None:
    # The command line, in a process of its own: the Ray driver and the controller, on the test cluster.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "RAY_"))}
    command = [
        sys.executable,
        "-m",
        "elastic_runtime.cli",
        "launch",
        "--backend",
        "ray",
        "--ray-address",
        cluster.address,
    ]
    command += ["--nprocs", str(NPROCS), "--steps", "8", "--run-dir", str(tmp_path / "run"), "--"]
    command += [sys.executable, "-m", "elastic_runtime.cli.demo_multiprocess", "--worker", "--steps", "8"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=_WAIT_S, cwd=Path.cwd())
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["ok"] and summary["step"] == 8 and summary["replacements"] == []
    # Nothing left behind: each worker removed its replica folder when told the run finished.
    assert not list(Path("/dev/shm").glob(f"elastic-runtime-{summary['run_id']}-*"))
    started = [e for e in read_events(tmp_path / "run" / "events.jsonl") if isinstance(e, WorkerStarted)]
    assert sorted(e.worker for e in started) == [0, 1, 2] and {e.source for e in started} == {"ray"}


# Long enough (0.4 s a step) for Ray to start the replacement before the run ends on a loaded machine: the group
# goes on without it (min_nprocs), and at 20 steps a run under load 10 ended first (no WorkerStarted of it).
STEPS_PAST_A_REPLACEMENT = 40


def test_a_crashed_worker_process_is_detected_by_heartbeat_and_ray_replaces_it(cluster: Any, tmp_path: Path) -> None:
    # The other signal: worker 1's process dies, its actor lives on. Ray reports nothing (its actor is fine);
    # the controller sees the connection close first, and the replacement still comes from Ray.
    run_dir = tmp_path / "run"
    with ray_session(cluster.address) as host:
        config = LaunchConfig(
            command=[],
            nprocs=NPROCS,
            min_nprocs=NPROCS - 1,
            target_steps=STEPS_PAST_A_REPLACEMENT,
            run_dir=str(run_dir),
            secret=auth.new_secret(),
            listen_host=host,
        )
        env = {"ELASTIC_STEP_DELAY_S": "0.4", "ELASTIC_COMPILE_CACHE": str(tmp_path / "xla-cache")}
        controller, placement = ray_controller(config, worker_command(STEPS_PAST_A_REPLACEMENT), env=env)
        outcome: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: outcome.update(result=controller.run()), name="controller")
        thread.start()
        try:
            deadline = time.monotonic() + _WAIT_S
            while not any(isinstance(e, StepCompleted) and e.step >= 3 for e in _events(run_dir)):
                assert thread.is_alive() and time.monotonic() < deadline, "no step 3"
                time.sleep(0.05)
            lost_node, lost_at = placement.placed[1].node, time.monotonic()
            os.kill(placement.placed[1].pid, signal.SIGKILL)
            thread.join(_WAIT_S)
            assert not thread.is_alive(), "the run did not end in time"
        finally:
            if thread.is_alive():
                controller.end(ElasticRuntimeError("the test failed"))
                thread.join(30)
            placement.close()
            for path in Path("/dev/shm").glob(f"elastic-runtime-{controller.record.run_id}-*"):
                shutil.rmtree(path, ignore_errors=True)
    result: LaunchResult = outcome["result"]
    assert result.ok and result.step == STEPS_PAST_A_REPLACEMENT, result.reason
    history = _events(run_dir)
    [lost] = [e for e in history if isinstance(e, WorkerLost)]
    assert lost.worker == 1 and lost.detected_by == "heartbeat" and lost.source == "heartbeat", lost
    assert lost.mono_time - lost_at <= 3.0
    assert placement.replacements == [(1, NPROCS)]
    assert placement.placed[NPROCS].node != lost_node  # a node that lost a worker is taken last
    assert sorted(e.worker for e in history if isinstance(e, WorkerStarted)) == [0, 1, 2, NPROCS]
    assert result.world_size_history[:2] == [NPROCS, NPROCS - 1] and result.survivor_restarts == 0
    assert result.recoveries and all(r["lost_steps"] == 0 for r in result.recoveries), result.recoveries


def _events(run_dir: Path) -> list[Any]:
    path = run_dir / "events.jsonl"
    return read_events(path) if path.exists() else []


@pytest.mark.heavy
def test_a_removed_ray_node_is_detected_by_ray_and_replaced_on_a_free_node(
    cluster: Any, tmp_path: Path, reference: Path
) -> None:
    run_dir = tmp_path / "run"
    outcome: dict[str, Any] = {}
    with ray_session(cluster.address) as host:
        assert host == "127.0.0.1"
        config = LaunchConfig(
            command=[],
            nprocs=NPROCS,
            min_nprocs=NPROCS - 1,
            target_steps=STEPS,
            run_dir=str(run_dir),
            secret=auth.new_secret(),
            listen_host=host,
        )
        env = {
            "ELASTIC_RESULT": str(tmp_path / "final"),  # process 0 commits the final state there
            # Room for what the test does while the run trains: the group grows back only until 5 steps before
            # the end, and the replacement took 3-13 s to say hello and join on a loaded 2-CPU machine.
            "ELASTIC_STEP_DELAY_S": "0.8",
            "ELASTIC_COMPILE_CACHE": str(tmp_path / "xla-cache"),
        }
        controller, placement = ray_controller(config, worker_command(STEPS), env=env)
        ray_logs = Path(cluster.head_node.get_session_dir_path())  # every node's, on this machine

        def run() -> None:
            try:
                outcome["result"] = controller.run()
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=run, name="controller")
        thread.start()
        try:

            def wait_for(what: str, condition: Callable[[], bool]) -> None:
                deadline = time.monotonic() + _WAIT_S
                while not condition():
                    assert thread.is_alive(), f"the controller ended before {what}: {outcome}"
                    assert time.monotonic() < deadline, f"no {what} within {_WAIT_S} s"
                    time.sleep(0.05)

            def committed(step: int) -> bool:
                path = run_dir / "events.jsonl"
                return path.exists() and any(isinstance(e, StepCompleted) and e.step >= step for e in read_events(path))

            wait_for("step 3", lambda: committed(3))
            lost_node = placement.placed[1].node
            [node] = [n for n in cluster.worker_nodes if n.node_id == lost_node]
            survivors = {w: (placement.placed[w].pid, placement.placed[w].node) for w in (0, 2)}
            orphan = placement.placed[1].pid  # its child: in a session of its own, it outlives the node's Ray
            lost_at = time.monotonic()  # the events' mono_time is the same clock
            cluster.remove_node(node)
            thread.join(_WAIT_S)
            assert not thread.is_alive(), "the run did not end in time"
        finally:
            if thread.is_alive():  # a failed wait: stop the run, its workers and its actors
                controller.end(ElasticRuntimeError("the test failed"))
                thread.join(30)
            placement.close()
            for placed in placement.placed.values():
                with contextlib.suppress(ProcessLookupError):
                    if placed.pid > 0 and _alive(placed.pid):
                        os.kill(placed.pid, signal.SIGKILL)
            for path in Path("/dev/shm").glob(f"elastic-runtime-{controller.record.run_id}-*"):
                shutil.rmtree(path, ignore_errors=True)

    assert "error" not in outcome, outcome.get("error")
    result: LaunchResult = outcome["result"]
    history = read_events(run_dir / "events.jsonl")
    assert result.ok and result.step == STEPS, result.reason

    # Detection: Ray's signal, first (the worker's process still ran and sent heartbeats: only Ray knew).
    [lost] = [e for e in history if isinstance(e, WorkerLost)]
    assert lost.worker == 1 and lost.detected_by == "ray" and lost.source == "ray", lost
    assert lost.message.startswith("Ray: the actor of worker 1 died (ActorDiedError"), lost.message
    detected_after_s = lost.mono_time - lost_at
    assert detected_after_s <= 3.0, detected_after_s
    # The orphaned process was told to exit at its next heartbeat, as a partitioned worker is.
    deadline = time.monotonic() + 30
    while _alive(orphan):
        assert time.monotonic() < deadline, f"worker 1's process {orphan} outlived the run"
        time.sleep(0.1)

    # Survivors went on at once; the replacement (a new id) joined on the free node; the group grew back.
    assert result.strategies == ["start", "reform", "grow"]
    assert result.world_size_history == [NPROCS, NPROCS - 1, NPROCS]
    formed = [set(e.members) for e in history if isinstance(e, GroupFormed)]
    assert formed == [{0, 1, 2}, {0, 2}, {0, 2, NPROCS}]
    assert placement.replacements == [(1, NPROCS)]
    replacement_node = placement.placed[NPROCS].node
    assert replacement_node != lost_node and replacement_node not in {node for _, node in survivors.values()}

    # Nothing restarted but the lost worker: the controller (one run), the survivors' actors and processes.
    assert sum(isinstance(e, RunStarted) for e in history) == 1
    started = [e.worker for e in history if isinstance(e, WorkerStarted)]
    assert sorted(started) == [0, 1, 2, NPROCS]
    assert {w: (placement.placed[w].pid, placement.placed[w].node) for w in (0, 2)} == survivors
    assert result.survivor_restarts == 0

    # 0 committed steps lost; the same final state as the fault-free run.
    assert_no_committed_step_lost(history)
    match = compare_states(final_state(tmp_path / "final"), final_state(reference), bitwise=False)
    assert match["match"], match

    # The secret went to the workers' environment only: in no log of Ray's or ours.
    secret = config.secret
    assert secret
    for folder in (ray_logs, tmp_path):
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_symlink() and path.stat().st_size < 64 << 20:
                assert secret.encode() not in path.read_bytes(), f"the secret is in {path}"

    # Figures, printed (this machine's load decides them); `pytest -s` shows them.
    before = max(e.step for e in history if isinstance(e, StepCompleted) and e.mono_time < lost_at)
    [next_commit] = [e for e in history if isinstance(e, StepCompleted) and e.step == before + 1]
    grown = [e for e in history if isinstance(e, GroupFormed) and len(e.members) == NPROCS][-1]
    figures = {
        "detected_by": lost.detected_by,
        "detected_after_s": round(detected_after_s, 3),
        "next_commit_after_s": round(next_commit.mono_time - lost_at, 3),
        "grown_back_after_s": round(grown.mono_time - lost_at, 3),
        "max_rel_error": match["max_rel_error"],
    }
    print(f"\nray node removed: {json.dumps(figures)}", file=sys.stderr)
