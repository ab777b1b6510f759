"""examples/slurm/elastic.sbatch on a real SLURM cluster: munged, slurmctld and one slurmd per simulated host.

The recipe is submitted with ``sbatch`` as a user would, with the demo's worker script: 3 workers on 4 nodes
(one spare), the controller on the first node. Mid-run one node's worker goes, and the recipe starts a
replacement with a new id on the spare node:

- ``step``: the worker's step is killed (``scancel --signal=KILL``). The survivors go on as a group of 2
  (``MIN_NPROCS=2``) and it grows back to 3 when the replacement says hello.
- ``slurmd``: the node's ``slurmd`` is killed with everything on it, so that only SLURM's own timeout
  (``SlurmdTimeout``) ends the step and reports the node down (srun then exits 0: the recipe must not take
  that for a finished worker). The survivors go on as a group of 2 and it grows back to 3.

The replacement must say hello before the last 5 steps (the group no longer grows that close to the end):
each step sleeps ``ELASTIC_STEP_DELAY_S`` so that it does, with room to spare on a loaded 2-core machine,
where the replacement's start (Python, jax, a compile) takes ~40 s and SLURM's detection of a dead slurmd
another ~15 s.

The final state matches the fault-free run's (1e-5 relative: some steps may run on a data axis of 2, not 3).

Needs the SLURM and munge programs (``.ci/install-slurm``) and root; without them the test skips with the
reason, and fails instead under ``ELASTIC_RUNTIME_REQUIRE_EMULATORS=1`` (CI sets it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from launch_support import NPROCS, STEPS  # as the fault-free `reference` run (conftest.py) has
from test_launcher_recovery import assert_no_committed_step_lost, final_state

from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupFormed, StepCompleted, WorkerLost
from elastic_runtime.testing.slurm import SlurmCluster, SlurmMissing

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "elastic.sbatch"
_WAIT_S = 120.0  # a bound on each wait below, so that a broken run fails instead of hanging
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", ""}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    """NPROCS + 1 nodes (one spare); its daemons' logs end up in ``tmp_path/slurm``."""
    try:
        slurm = SlurmCluster(NPROCS + 1, logs=tmp_path / "slurm")
        slurm.__enter__()
    except (SlurmMissing, RuntimeError) as exc:
        message = f"SLURM unavailable, the real-SLURM test NOT run: {exc}"
        if os.environ.get("ELASTIC_RUNTIME_REQUIRE_EMULATORS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield slurm
    finally:
        slurm.close()


def wait_for(what: str, condition: Callable[[], bool], cluster: SlurmCluster, job: int, out: Path) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():
        state = cluster.job_state(job)
        if state in _ENDED and condition():  # it came between the two looks (the job's end itself, say)
            return
        assert state not in _ENDED, f"job {state or 'gone'} before {what}:\n{read(out)}"
        assert time.monotonic() < deadline, f"no {what} within {_WAIT_S} s:\n{read(out)}"
        time.sleep(0.2)


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def events(run_dir: Path) -> list[Any]:
    path = run_dir / "events.jsonl"
    return read_events(path) if path.exists() else []


@pytest.mark.parametrize("fault", ["step", "slurmd"])
def test_the_recipe_replaces_a_lost_worker_on_real_slurm(
    cluster: SlurmCluster, tmp_path: Path, reference: Path, fault: str
) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "SLURM_"))}
    env |= {
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",  # `python` and `elastic-runtime` of this venv
        "PYTHONPATH": str(ROOT),
        "NPROCS": str(NPROCS),
        "MIN_NPROCS": str(NPROCS - 1),
        "STEPS": str(STEPS),
        "POLL_S": "0.5",
        "RUN_DIR": str(run_dir),
        # srun passes these on to every worker: the final state's folder (process 0 commits it), the time a
        # replacement needs to join (see above), the XLA cache the workers share.
        "ELASTIC_RESULT": str(tmp_path / "final"),
        "ELASTIC_STEP_DELAY_S": "1.5" if fault == "step" else "2.5",
        "ELASTIC_COMPILE_CACHE": str(tmp_path / "xla-cache"),
    }
    args = [f"--nodes={NPROCS + 1}", f"--output={out}", f"--chdir={ROOT}", str(SBATCH)]
    job = cluster.sbatch(args, env, ROOT)

    def committed(step: int) -> bool:
        return any(isinstance(e, StepCompleted) and e.step >= step for e in events(run_dir))

    wait_for("step 2", lambda: committed(2), cluster, job, out)
    lost_at = time.monotonic()  # the events' mono_time is the same clock (CLOCK_MONOTONIC, one machine)
    if fault == "step":
        [step] = [s for s, (name, node) in cluster.steps(job).items() if name == "python" and node == "host1"]
        cluster.cancel_step(job, step)
    else:
        cluster.hosts.kill(1)  # slurmd, its slurmstepds and the worker: SLURM learns it only by timeout
    ended: list[str] = []
    wait_for(
        "the end of the job", lambda: ended.append(cluster.job_state(job)) or ended[-1] in _ENDED, cluster, job, out
    )
    state, text = ended[-1], read(out)
    assert state == "COMPLETED", f"job {state}:\n{text}"

    summary = json.loads((run_dir / "summary.json").read_text())
    history = read_events(run_dir / "events.jsonl")
    assert summary["ok"] and summary["step"] == STEPS, summary
    # The replacement: a new id (the controller refuses one it has seen) on the spare node.
    assert f"replacing worker 1 with worker {NPROCS} on host{NPROCS}" in text, text
    if fault == "slurmd":
        assert "node host1 is down: not used again" in text, text
        assert cluster.node_state("host1").startswith("down"), cluster.node_state("host1")
    [lost] = [e for e in history if isinstance(e, WorkerLost)]
    assert lost.worker == 1, lost
    # On without it, then grown back with its replacement.
    assert summary["strategies"] == ["start", "reform", "grow"], summary
    assert summary["world_size_history"] == [NPROCS, NPROCS - 1, NPROCS], summary
    formed = [e for e in history if isinstance(e, GroupFormed)]
    assert [set(e.members) for e in formed] == [{0, 1, 2}, {0, 2}, {0, 2, 3}]
    assert_no_committed_step_lost(history)
    match = compare_states(final_state(tmp_path / "final"), final_state(reference), bitwise=False)
    assert match["match"], match

    # Figures, printed (not asserted: this machine's load decides them); `pytest -s` shows them.
    before = max(e.step for e in history if isinstance(e, StepCompleted) and e.mono_time < lost_at)
    [next_commit] = [e for e in history if isinstance(e, StepCompleted) and e.step == before + 1]
    figures = {
        "detected_after_s": round(lost.mono_time - lost_at, 3),
        "next_commit_after_s": round(next_commit.mono_time - lost_at, 3),
        "full_size_after_s": round(formed[-1].mono_time - lost_at, 3),
        "max_rel_error": match["max_rel_error"],
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
    print(f"\nSLURM, {fault} lost: {json.dumps(figures)}")
