"""A maintenance notice drains a host's worker before the window: 4 simulated hosts, the notice from the real
Pub/Sub emulator or from the host's own (fake) metadata server.

``elastic-runtime controller --maintenance-subscription`` in the root namespace, worker K on host K (its
instance name is its host name, ``hostK``). A Cloud Logging ``compute.instances.upcomingMaintenance`` notice
(this project's fixture format) for ``host2`` is published with its window 10 s ahead: host 2's worker leaves
the group at a planned step before the window, no step lost, no failure counted; after the ``Completed``
notice, a worker started again on host 2 grows the group back to 4; the final state matches a fault-free run
of 4 processes (1e-5 relative: some steps ran on a data axis of 3). The same notice through the metadata server
on host 2 (its worker forwards it to the controller) has the same outcome; host 2 is re-admitted when the
window it announced has ended.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from metadata_server import NO_NOTIFICATIONS, FakeMetadataServer
from notices import rfc3339, upcoming
from pubsub_support import Topic

from elastic_runtime.cli.demo_multiprocess import run_group
from elastic_runtime.cluster.controller.coordination import free_port
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import (
    GroupFormed,
    MaintenanceCompleted,
    MaintenanceScheduled,
    RecoveryStarted,
    StepCompleted,
    WorkerLost,
)
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.testing.hosts import SimulatedHosts

# Minutes each (simulated hosts, a reference run): in `make test-heavy`, not `make test`.
pytestmark = [pytest.mark.timeout(400), pytest.mark.heavy]

HOSTS = 4
STEPS = 150  # at 0.3 s a step: time for the replacement to start (JAX's import) and grow the group back
_WAIT_S = 150.0  # a bound on each wait, so that a broken run fails instead of hanging


def final_state(folder: Path) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(DiskTier(folder).latest(None).tree)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The final state of a fault-free run of the same group (4 processes)."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_group(processes=HOSTS, steps=STEPS, run_dir=run_dir, faults=[]).ok
    return run_dir / "final"


class HostsRun:
    """``elastic-runtime controller`` in the root namespace and the workers the test starts on the hosts."""

    def __init__(self, hosts: SimulatedHosts, tmp_path: Path, controller_args: list[str]) -> None:
        self.hosts, self.tmp_path = hosts, tmp_path
        self.run_dir = tmp_path / "run"
        token = tmp_path / "token"
        token.write_text(os.urandom(32).hex())
        token.chmod(0o600)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}  # PUBSUB_EMULATOR_HOST kept
        env["ELASTIC_RUNTIME_TOKEN_FILE"] = str(token)
        address = f"{hosts.controller_address}:{free_port(hosts.controller_address)}"
        low = free_port(hosts.controller_address)
        command = [sys.executable, "-m", "elastic_runtime.cli", "controller", "--listen", address]
        command += ["--nprocs", str(HOSTS), "--min-nprocs", str(HOSTS - 1), "--steps", str(STEPS)]
        command += ["--run-dir", str(self.run_dir), "--coordinator-ports", f"{low}-{low + 20}", *controller_args]
        with open(tmp_path / "controller.log", "wb") as log:
            self.controller = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log)
        self.worker_env = env | {
            "ELASTIC_CONTROLLER": address,
            "ELASTIC_RESULT": str(tmp_path / "final"),
            "ELASTIC_STEP_DELAY_S": "0.3",
            "ELASTIC_COMPILE_CACHE": str(tmp_path / "xla-cache"),
        }

    def start(self, host: int, worker_id: int, **env: str) -> None:
        worker = [sys.executable, "-m", "elastic_runtime.cli.demo_multiprocess", "--worker", "--steps", str(STEPS)]
        env_k = self.worker_env | {"ELASTIC_WORKER_ID": str(worker_id)} | env
        self.hosts.start(host, worker, env_k, self.tmp_path / f"worker-{worker_id}.log")

    def wait_for(self, what: str, condition: Callable[[list[Any]], bool]) -> None:
        events = self.run_dir / "events.jsonl"
        deadline = time.monotonic() + _WAIT_S
        while not condition(read_events(events) if events.exists() else []):
            assert self.controller.poll() is None, f"the controller exited before {what}"
            assert time.monotonic() < deadline, f"no {what} within {_WAIT_S} s"
            time.sleep(0.1)

    def finish(self) -> tuple[dict[str, Any], list[Any]]:
        """The controller's result line and the run's events, once it ended."""
        out, _ = self.controller.communicate(timeout=_WAIT_S)
        assert self.controller.returncode == 0, (self.tmp_path / "controller.log").read_text()
        return json.loads(out.decode().strip().splitlines()[-1]), read_events(self.run_dir / "events.jsonl")

    def close(self) -> None:
        if self.controller.poll() is None:
            self.controller.kill()
            self.controller.wait()
        if self.controller.stdout is not None:
            self.controller.stdout.close()


def step_3(seen: list[Any]) -> bool:
    return any(isinstance(e, StepCompleted) and e.step >= 3 for e in seen)


def formed(members: int) -> Callable[[list[Any]], bool]:
    return lambda seen: any(isinstance(e, GroupFormed) and len(e.members) == members for e in seen)


def check_drained_and_grown_back(
    result: dict[str, Any],
    history: list[Any],
    *,
    instance: str,
    window: float,
    left: float,
    final: Path,
    reference: Path,
) -> None:
    """Out before the window, nothing lost or counted, back to 4, the fault-free run's state."""
    assert result["ok"] and result["step"] == STEPS
    assert result["strategies"] == ["start", "drain", "grow"]
    assert result["world_size_history"] == [HOSTS, HOSTS - 1, HOSTS]
    assert result["recoveries"] == [] and result["survivor_restarts"] == 0  # nothing counted as a failure
    assert not [e for e in history if isinstance(e, WorkerLost | RecoveryStarted)]
    assert {e.instance for e in history if isinstance(e, MaintenanceScheduled)} == {instance}
    groups = [e for e in history if isinstance(e, GroupFormed)]
    everyone = sorted(["host0", "host1", "host3", instance])
    assert [sorted(g.instances) for g in groups] == [everyone, sorted(set(everyone) - {instance}), everyone]
    drained = groups[1]
    assert left < window, f"host 2's worker left {left - window:.1f} s after the window opened"
    # 0 steps lost: the group without the host goes on from the newest step the whole group had committed.
    before = max(e.step for e in history if isinstance(e, StepCompleted) and e.mono_time < drained.mono_time)
    assert drained.restore_step == before
    assert [e.step for e in history if isinstance(e, StepCompleted)] == list(range(1, STEPS + 1))  # each once
    match = compare_states(final_state(final), final_state(reference), bitwise=False)
    assert match["match"], match
    figures = f"left {window - left:.1f} s, new group formed {window - drained.wall_time:.1f} s before the window"
    print(f"\ndrain: {figures}; max_rel_error {match['max_rel_error']}")


def test_a_scheduled_maintenance_drains_the_host_before_its_window_and_the_group_grows_back(
    tmp_path: Path, topic: Topic, reference: Path
) -> None:
    with SimulatedHosts(HOSTS) as hosts:
        run = HostsRun(hosts, tmp_path, ["--maintenance-subscription", topic.subscription])
        try:
            for k in range(HOSTS):
                run.start(k, k)
            run.wait_for("step 3", step_3)
            window = time.time() + 10.0
            topic.publish(upcoming(name="host2", start=window, end=window + 20))
            run.wait_for("host 2's worker to leave", lambda seen: not hosts.pids(2))
            left = time.time()  # its process exited (it stops at the planned step): out of the group
            run.wait_for("the group without host 2", formed(HOSTS - 1))
            topic.publish(upcoming(name="host2", start=window, end=window + 20, status="COMPLETED"))
            run.wait_for("the Completed notice", lambda seen: any(isinstance(e, MaintenanceCompleted) for e in seen))
            run.start(2, HOSTS)  # host 2 is back: its scheduler starts a worker there again, with a new id
            result, history = run.finish()
        finally:
            run.close()
    check_drained_and_grown_back(
        result, history, instance="host2", window=window, left=left, final=tmp_path / "final", reference=reference
    )
    completed = next(e for e in history if isinstance(e, MaintenanceCompleted))
    assert [e for e in history if isinstance(e, GroupFormed)][2].wall_time > completed.wall_time


def test_the_same_notice_through_the_hosts_metadata_server_drains_it_too(tmp_path: Path, reference: Path) -> None:
    with SimulatedHosts(HOSTS) as hosts, FakeMetadataServer(bind=hosts.controller_address) as metadata:
        metadata.set("instance/name", b"vm-host2")  # host 2's worker names its instance after the server
        metadata.set("instance/upcoming-maintenance", b"{}")  # nothing announced (long polls wait on its ETag)
        run = HostsRun(hosts, tmp_path, [])
        try:
            for k in range(HOSTS):
                run.start(k, k, **({"ELASTIC_METADATA_HOST": metadata.host} if k == 2 else {}))
            run.wait_for("step 3", step_3)
            window = time.time() + 10.0
            announced = {
                "type": "SCHEDULED",
                "maintenance_status": "PENDING",
                "window_start_time": rfc3339(window),
                "window_end_time": rfc3339(window + 10),
            }
            metadata.set("instance/upcoming-maintenance", json.dumps(announced).encode())
            run.wait_for("host 2's worker to leave", lambda seen: not hosts.pids(2))
            left = time.time()  # its process exited (it stops at the planned step): out of the group
            run.wait_for("the group without host 2", formed(HOSTS - 1))
            metadata.set("instance/upcoming-maintenance", NO_NOTIFICATIONS, status=503)  # over, once the window is
            run.start(2, HOSTS, ELASTIC_METADATA_HOST=metadata.host)  # seated once the window has ended
            result, history = run.finish()
        finally:
            run.close()
    check_drained_and_grown_back(
        result,
        history,
        instance="vm-host2",
        window=window,
        left=left,
        final=tmp_path / "final",
        reference=reference,
    )
    notices = [e for e in history if isinstance(e, MaintenanceScheduled)]
    assert {e.source for e in notices} == {"metadata@worker-2"}
    assert [e for e in history if isinstance(e, GroupFormed)][2].wall_time > window + 10  # after the window ended


def test_a_notice_whose_window_is_already_open_is_handled_as_a_loss_and_said_to_be_late(
    tmp_path: Path, topic: Topic, reference: Path
) -> None:
    with SimulatedHosts(HOSTS) as hosts:
        run = HostsRun(hosts, tmp_path, ["--maintenance-subscription", topic.subscription])
        try:
            for k in range(HOSTS):
                run.start(k, k)
            run.wait_for("step 3", step_3)
            opened = time.time() - 5.0
            topic.publish(upcoming(name="host2", start=opened, end=opened + 30))
            run.wait_for("the group without host 2", formed(HOSTS - 1))
            topic.publish(upcoming(name="host2", start=opened, end=opened + 30, status="COMPLETED"))
            run.wait_for("the Completed notice", lambda seen: any(isinstance(e, MaintenanceCompleted) for e in seen))
            run.start(2, HOSTS)
            result, history = run.finish()
        finally:
            run.close()
    assert result["ok"] and result["step"] == STEPS
    assert result["strategies"] == ["start", "reform", "grow"]  # a loss, not a planned drain
    [recovery] = result["recoveries"]  # counted against the failure budget
    assert "too late for a planned drain" in recovery["cause"], recovery
    [started] = [e for e in history if isinstance(e, RecoveryStarted)]
    assert "MaintenanceScheduled for host2" in started.cause
    match = compare_states(final_state(tmp_path / "final"), final_state(reference), bitwise=False)
    assert match["match"], match
