"""Losses that come together re-form together (``runtime/cluster/controller/supervisor.py``), with real processes:
4 workers and one warm spare; two are killed at the same instant, or one at step 6 and a second while the group
re-forms for it (seated, before the others got past JAX's start). Either way no survivor is killed or restarted,
the group re-forms once (a second spare takes the lost seat in the same generation), the failure budget counts
the two real losses, and the final state is bitwise the fault-free run's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from runtime.cli.demo_multiprocess import run_group
from runtime.cluster.protocol import ENV_JAX_INIT_S, ENV_STEP_DELAY_S
from runtime.core.eventlog import read_events
from runtime.core.events import GroupFormed, RecoveryStarted, WorkerHung, WorkerKilled
from runtime.faults.grammar import parse_faults
from runtime.testing.compare import compare_states
from storage.disk import DiskTier

STEPS = 24
NPROCS = 4

pytestmark = pytest.mark.timeout(400)


def final(folder: Path) -> Any:
    return DiskTier(folder).latest(None).tree


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_group(processes=NPROCS, steps=STEPS, run_dir=run_dir, faults=[]).ok
    return run_dir / "final"


@pytest.mark.parametrize("faults", ["kill:2@6,kill:3@6", "kill:2@6,kill:3@forming"], ids=["together", "forming"])
def test_two_workers_lost_together_re_form_once_and_no_survivor_is_killed(
    tmp_path: Path, reference: Path, faults: str
) -> None:
    result = run_group(
        processes=NPROCS,
        steps=STEPS,
        run_dir=tmp_path,
        faults=parse_faults(faults),
        spares=1,
        max_failures=2,  # the two real losses, nothing more
        # Hang guards only: a cold spare under load may take long to start, and the survivors wait for it in
        # JAX's start meanwhile; a group that does not form in time would be restarted (not what is tested).
        form_timeout_s=120.0,
        extra_env={ENV_STEP_DELAY_S: "0.1", ENV_JAX_INIT_S: "300"},
    )
    assert result.ok and result.step == STEPS, result.reason
    events = read_events(tmp_path / "events.jsonl")
    killed = [e for e in events if isinstance(e, WorkerKilled)]
    assert all("fault injection" in e.reason for e in killed) and len(killed) == 2, killed
    assert not [e for e in events if isinstance(e, WorkerHung)]
    assert result.survivor_restarts == 0 and "restart" not in result.strategies, result.strategies
    formed = [e for e in events if isinstance(e, GroupFormed)]
    assert len(formed) == 2, [(e.generation, e.members) for e in formed]  # the start and one re-form
    assert len([e for e in events if isinstance(e, RecoveryStarted)]) == 2  # one per real loss
    print(f"recovery {result.recoveries[0]['recovery_s']:.2f} s at load {os.getloadavg()}")
    match = compare_states(final(tmp_path / "final"), final(reference), bitwise=True)
    assert match["match"], match
