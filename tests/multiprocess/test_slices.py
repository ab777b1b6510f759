"""Slices: the state sharded over the processes of a slice, slices replicating each other (storage/boxes.py;
the collectives that move shards between processes: runtime/cluster/collectives.py).

Real worker processes with ``kill -9``: a lost process's shards come from the other slice when there is one,
else from its neighbour's RAM (neighbour replicas on) or its replica file; each process's replica holds only its
own shards; the result matches a fault-free run of the same layout bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import pytest
from launch_support import lose_after_durable

from elastic_runtime.cli.demo_multiprocess import FEATURES, HIDDEN, group_controller, run_group, wipe_lost_replicas
from elastic_runtime.cluster.protocol import ENV_STEP_DELAY_S
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import RecoveryCompleted
from elastic_runtime.faults.grammar import Fault, parse_faults
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.testing.demo_model import init_state
from elastic_runtime.testing.gcs_emulator import running_emulator

STEPS = 30


def final(run_dir: Path) -> object:
    return DiskTier(run_dir / "final").latest(None).tree


def replica_shapes(replicas: Path) -> set[tuple[int, ...]]:
    """The shapes of w1 in every replica file written."""
    shapes = set()
    for folder in replicas.glob("worker-*"):
        tier = DiskTier(folder, name="shm", check_space=False)
        for step in tier.steps(timeout=10):
            shapes |= {tuple(leaf.shape) for leaf in tier.manifest(step).leaves if leaf.key[-1] == "w1"}
    return shapes


def run(tmp_path: Path, name: str, *, processes: int, slices: int, kill: int | None, faults: Any = ()) -> Any:
    faults = [*faults, *([] if kill is None else [Fault("kill", kill, step=10)])]
    return run_group(
        processes=processes,
        slices=slices,
        steps=STEPS,
        run_dir=tmp_path / name,
        faults=faults,
        replica_dir=str(tmp_path / name / "replicas"),
    )


@pytest.mark.timeout(240)
def test_a_lost_process_takes_its_shards_from_the_other_slice(tmp_path: Path) -> None:
    result = run(tmp_path, "run", processes=4, slices=2, kill=1)
    assert result.ok and result.step == STEPS, result.reason
    (recovery,) = result.recoveries
    # From the other slice's memory; or, when the survivors' newest steps differ by one (a step abandoned
    # mid-way), the step before, which a survivor may read back from its own replica file.
    assert recovery["restored_from"].startswith(("ram", "disk+ram", "file")), recovery
    assert recovery["lost_steps"] == 0
    assert result.survivor_restarts == 0 and result.world_size_history == [4, 4]
    # Each process holds (and writes) half of the hidden layer: the slice's 2 processes x 2 devices split it.
    assert replica_shapes(tmp_path / "run" / "replicas") == {(FEATURES, HIDDEN // 2)}
    reference = run(tmp_path, "reference", processes=4, slices=2, kill=None)
    assert reference.ok
    assert compare_states(final(tmp_path / "run"), final(tmp_path / "reference"), bitwise=True)["match"]


@pytest.mark.timeout(240)
def test_with_one_slice_the_lost_shards_come_from_the_lost_process_replica_file(tmp_path: Path) -> None:
    result = run(tmp_path, "run", processes=2, slices=1, kill=1)
    assert result.ok and result.step == STEPS, result.reason
    (recovery,) = result.recoveries
    # The survivor keeps its shards in memory; only the lost process's come from a file (maybe a step older,
    # and then the survivor rolls back to it from its own file).
    assert "disk" in recovery["restored_from"] and recovery["strategy"] == "reform"  # files in tmp_path
    assert result.survivor_restarts == 0
    assert replica_shapes(tmp_path / "run" / "replicas") == {(FEATURES, HIDDEN // 2)}
    assert run(tmp_path, "reference", processes=2, slices=1, kill=None).ok
    assert compare_states(final(tmp_path / "run"), final(tmp_path / "reference"), bitwise=True)["match"]


@pytest.mark.timeout(240)
def test_a_process_hung_at_the_last_step_leaves_the_other_in_the_final_gather_and_it_reforms(tmp_path: Path) -> None:
    # Process 1 computes the last step and hangs before committing it; process 0 commits it and enters the
    # final gather of the sharded state (a collective) with a peer that never joins. It must still hear the
    # next Form: the hung process is replaced and the group re-forms from the last step, nobody restarts.
    result = run(tmp_path, "run", processes=2, slices=1, kill=None, faults=parse_faults(f"hang:1@{STEPS}"))
    assert result.ok and result.step == STEPS, result.reason
    assert result.strategies == ["start", "reform"] and result.survivor_restarts == 0, result.strategies
    assert run(tmp_path, "reference", processes=2, slices=1, kill=None).ok
    assert compare_states(final(tmp_path / "run"), final(tmp_path / "reference"), bitwise=True)["match"]


@pytest.mark.timeout(300)
def test_with_neighbour_replicas_a_lost_host_shards_come_from_its_neighbour_not_from_gcs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_emulator("neighbours", tmp_path / "emulator.log") as emulator:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.url)  # the workers started here inherit it
        controller = group_controller(
            processes=4,
            slices=1,
            steps=STEPS,
            run_dir=tmp_path / "run",
            faults=[],
            replica_dir=str(tmp_path / "run" / "replicas"),
            durable_dir="gs://neighbours/run",
            durable_every=10,
            neighbour_replicas=True,
            extra_env={ENV_STEP_DELAY_S: "0.3"},  # uploads to the emulator take a few steps
        )
        committed = lose_after_durable(controller, 0)  # process 0's host: its RAM and /dev/shm with it
        wipe_lost_replicas(controller)
        result = controller.run()
    assert result.ok and result.step == STEPS, result.reason
    assert committed and committed[0] >= 10
    (recovery,) = result.recoveries
    # Process 1 kept process 0's shards (the slice wraps around); the others kept their own: nothing from GCS.
    assert recovery["restored_from"] == "neighbour+ram" and recovery["lost_steps"] == 0, recovery
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(init_state(FEATURES, HIDDEN)))
    assert recovery["bytes_by_tier"] == {"ram": 3 * whole // 4, "neighbour": whole // 4}, recovery
    assert set(recovery["read_s_by_tier"]) == {"ram", "neighbour"} and recovery["transfer_s"] > 0, recovery
    [done] = [e for e in read_events(result.events_path) if isinstance(e, RecoveryCompleted)]
    assert (done.bytes_by_tier, done.transfer_s) == (recovery["bytes_by_tier"], recovery["transfer_s"])
    assert result.survivor_restarts == 0
    assert run(tmp_path, "reference", processes=4, slices=1, kill=None).ok
    assert compare_states(final(tmp_path / "run"), final(tmp_path / "reference"), bitwise=True)["match"]
