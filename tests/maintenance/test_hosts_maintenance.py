"""A maintenance notice drains a host's worker before the window: 4 simulated hosts, the real Pub/Sub emulator.

``elastic-runtime controller --maintenance-subscription`` in the root namespace, worker K on host K (its
instance name is its host name, ``hostK``). A Cloud Logging ``compute.instances.upcomingMaintenance`` notice
(this project's fixture format) for ``host2`` is published with its window 10 s ahead: host 2's worker leaves
the group at a planned step before the window, no step lost, no failure counted; after the ``Completed``
notice, a worker started again on host 2 grows the group back to 4; the final state matches a fault-free run
of 4 processes (1e-5 relative: some steps ran on a data axis of 3).
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
from notices import upcoming
from pubsub_support import Topic

from runtime.cli.demo_multiprocess import run_group
from runtime.cluster.controller.coordination import free_port
from runtime.core.eventlog import read_events
from runtime.core.events import (
    GroupFormed,
    MaintenanceCompleted,
    MaintenanceScheduled,
    RecoveryStarted,
    StepCompleted,
    WorkerLost,
)
from runtime.testing.compare import compare_states
from runtime.testing.hosts import SimulatedHosts
from storage.disk import DiskTier

pytestmark = pytest.mark.timeout(400)

HOSTS = 4
STEPS = 150  # at 0.3 s a step: time for the replacement to start (JAX's import) and grow the group back
_WAIT_S = 150.0  # a bound on each wait, so that a broken run fails instead of hanging


def final_state(folder: Path) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(DiskTier(folder).latest(None).tree)]


def test_a_scheduled_maintenance_drains_the_host_before_its_window_and_the_group_grows_back(
    tmp_path: Path, topic: Topic
) -> None:
    reference = run_group(processes=HOSTS, steps=STEPS, run_dir=tmp_path / "reference", faults=[])
    assert reference.ok
    run_dir = tmp_path / "run"
    events = run_dir / "events.jsonl"
    token = tmp_path / "token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}  # PUBSUB_EMULATOR_HOST kept
    env["ELASTIC_RUNTIME_TOKEN_FILE"] = str(token)
    with SimulatedHosts(HOSTS) as hosts:
        address = f"{hosts.controller_address}:{free_port(hosts.controller_address)}"
        low = free_port(hosts.controller_address)
        command = [sys.executable, "-m", "runtime.cli", "controller", "--listen", address]
        command += ["--nprocs", str(HOSTS), "--min-nprocs", str(HOSTS - 1), "--steps", str(STEPS)]
        command += ["--run-dir", str(run_dir), "--coordinator-ports", f"{low}-{low + 20}"]
        command += ["--maintenance-subscription", topic.subscription]
        with open(tmp_path / "controller.log", "wb") as log:
            controller = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log)
        try:
            worker_env = env | {
                "ELASTIC_CONTROLLER": address,
                "ELASTIC_RESULT": str(tmp_path / "final"),
                "ELASTIC_STEP_DELAY_S": "0.3",
                "ELASTIC_COMPILE_CACHE": str(tmp_path / "xla-cache"),
            }
            worker = [sys.executable, "-m", "runtime.cli.demo_multiprocess", "--worker", "--steps", str(STEPS)]

            def start(host: int, worker_id: int) -> None:
                env_k = worker_env | {"ELASTIC_WORKER_ID": str(worker_id)}
                hosts.start(host, worker, env_k, tmp_path / f"worker-{worker_id}.log")

            def wait_for(what: str, condition: Callable[[list[Any]], bool]) -> None:
                deadline = time.monotonic() + _WAIT_S
                while not condition(read_events(events) if events.exists() else []):
                    assert controller.poll() is None, f"the controller exited before {what}"
                    assert time.monotonic() < deadline, f"no {what} within {_WAIT_S} s"
                    time.sleep(0.1)

            def formed(members: int) -> Callable[[list[Any]], bool]:
                return lambda seen: any(isinstance(e, GroupFormed) and len(e.members) == members for e in seen)

            for k in range(HOSTS):
                start(k, k)
            wait_for("step 3", lambda seen: any(isinstance(e, StepCompleted) and e.step >= 3 for e in seen))
            window = time.time() + 10.0
            topic.publish(upcoming(name="host2", start=window, end=window + 20))
            wait_for("the group without host 2", formed(HOSTS - 1))
            topic.publish(upcoming(name="host2", start=window, end=window + 20, status="COMPLETED"))
            wait_for("the Completed notice", lambda seen: any(isinstance(e, MaintenanceCompleted) for e in seen))
            start(2, HOSTS)  # host 2 is back: its scheduler starts a worker there again, with a new id
            out, _ = controller.communicate(timeout=_WAIT_S)
        finally:
            if controller.poll() is None:
                controller.kill()
                controller.wait()
            if controller.stdout is not None:
                controller.stdout.close()
    log_text = (tmp_path / "controller.log").read_text()
    assert controller.returncode == 0, log_text
    result = json.loads(out.decode().strip().splitlines()[-1])
    history = read_events(run_dir / "events.jsonl")

    assert result["ok"] and result["step"] == STEPS
    assert result["strategies"] == ["start", "drain", "grow"]
    assert result["world_size_history"] == [HOSTS, HOSTS - 1, HOSTS]
    assert result["recoveries"] == [] and result["survivor_restarts"] == 0  # nothing counted as a failure
    assert not [e for e in history if isinstance(e, WorkerLost | RecoveryStarted)]
    [notice] = [e for e in history if isinstance(e, MaintenanceScheduled)]
    assert notice.instance == "host2"
    groups = [e for e in history if isinstance(e, GroupFormed)]
    assert [sorted(g.instances) for g in groups] == [
        ["host0", "host1", "host2", "host3"],
        ["host0", "host1", "host3"],
        ["host0", "host1", "host2", "host3"],
    ]
    drained = groups[1]
    assert drained.wall_time < window, f"drained {drained.wall_time - window:.1f} s after the window opened"
    # 0 steps lost: the group without host 2 goes on from the newest step the whole group had committed.
    before = max(e.step for e in history if isinstance(e, StepCompleted) and e.mono_time < drained.mono_time)
    assert drained.restore_step == before
    steps = [e.step for e in history if isinstance(e, StepCompleted)]
    assert steps == list(range(1, STEPS + 1))  # each step once, none again
    completed = next(e for e in history if isinstance(e, MaintenanceCompleted))
    assert groups[2].wall_time > completed.wall_time
    want = final_state(tmp_path / "reference" / "final")
    match = compare_states(final_state(tmp_path / "final"), want, bitwise=False)
    assert match["match"], match
    print(f"\ndrain: out {window - drained.wall_time:.1f} s before the window; max_rel_error {match['max_rel_error']}")
