"""The group's durable checkpoints (storage/sharded.py, runtime/cluster/durable.py), with real processes.

One slice of 4 processes, the state sharded over all of them, durable checkpoints every 5 steps. A process is
killed with ``kill -9`` and its replica files are deleted (a lost host's RAM and ``/dev/shm``): the group rolls
back to the newest durable step, the survivors read their own shards from their own replica files and only the
lost process's shards come from the durable tier. The checkpoint the 4 processes wrote restores with plain
Orbax in this one process onto another mesh, and a damaged chunk is found by its checksum.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from runtime.cli.demo_multiprocess import FEATURES, HIDDEN, group_controller, wipe_lost_replicas
from runtime.cluster.protocol import ENV_STEP_DELAY_S
from runtime.core.errors import CheckpointInvalid
from runtime.core.eventlog import read_events
from runtime.core.events import CheckpointCommitted, CheckpointCorrupt, StateRestored
from runtime.testing.compare import compare_states
from runtime.testing.demo_model import init_state
from runtime.testing.gcs_emulator import running_emulator
from runtime.testing.grammar import Fault
from storage.disk import DiskTier
from storage.gcs import GcsTier
from storage.sharded import ShardedStore

STEPS = 30
EVERY = 5


def run(
    run_dir: Path,
    *,
    kill: int | None,
    damage: int | None = None,
    durable: str | None = None,
    kill_after_commit: int | None = None,
    step_delay_s: float = 0.0,
    every: int = EVERY,
) -> tuple[Any, list[int]]:
    """The demo job on 1 slice x 4 processes; the killed worker's replica files are deleted as it dies. With
    ``damage``, one bit of process 2's chunk of w1 in that durable step is flipped as soon as it commits; with
    ``kill_after_commit``, process 2 is killed once that durable step is committed (not at a fixed step)."""
    replicas = run_dir / "replicas"
    controller = group_controller(
        processes=4,
        slices=1,
        steps=STEPS,
        run_dir=run_dir,
        faults=[] if kill is None else [Fault("kill", kill, step=13)],
        replica_dir=str(replicas),
        durable_dir=durable or str(run_dir / "durable"),
        durable_every=every,
        extra_env={ENV_STEP_DELAY_S: str(step_delay_s)},
    )
    committed: list[int] = []

    async def note(event: CheckpointCommitted, ctx: Any) -> None:
        committed.append(event.step)
        if kill_after_commit is not None and event.step >= kill_after_commit and len(committed) == 1:
            ctx.signal(ctx.members[2], "KILL", "test: its host is lost")
        if event.step == damage:
            flip_bit(Path(event.path) / "state" / "params.w1" / "0.2")

    wipe_lost_replicas(controller)
    controller.bus.subscribe(CheckpointCommitted, note)
    return controller.run(), committed


def restored_steps(result: Any) -> list[int]:
    """The steps the run's re-formed groups restored, in order."""
    return [e.step for e in read_events(result.events_path) if isinstance(e, StateRestored)]


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def lost(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, list[int]]:
    run_dir = tmp_path_factory.mktemp("durable") / "run"
    result, committed = run(run_dir, kill=2)
    return run_dir, result, committed


@pytest.mark.timeout(300)
def test_only_the_lost_process_shards_come_from_the_durable_tier(lost: tuple[Path, Any, list[int]]) -> None:
    _, result, committed = lost
    assert result.ok and result.step == STEPS, result.reason
    assert {5, 10, 15, 20, 25, 30} >= set(committed) >= {10, 30}
    (recovery,) = result.recoveries
    assert recovery["restored_from"] == "durable+file", recovery
    assert restored_steps(result) == [10] and recovery["lost_steps"] >= 3  # from step 13 (or 14) back to 10
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(init_state(FEATURES, HIDDEN)))
    by_tier = recovery["bytes_by_tier"]
    # The replacement read one quarter of the state (its shards, and each array's small .zarray) from the
    # durable tier; the survivors their own three quarters from their replica files on this disk.
    assert whole // 4 <= by_tier["durable"] <= whole // 4 + 6 * 256, by_tier
    assert by_tier["disk"] == 3 * whole // 4, by_tier
    assert result.survivor_restarts == 0


@pytest.mark.timeout(300)
def test_the_result_matches_a_fault_free_run(lost: tuple[Path, Any, list[int]], tmp_path: Path) -> None:
    run_dir = lost[0]
    reference, _ = run(tmp_path / "reference", kill=None)
    assert reference.ok
    got, want = (DiskTier(d / "final").latest(None).tree for d in (run_dir, tmp_path / "reference"))
    assert compare_states(got, want, bitwise=True)["match"]


def test_a_checkpoint_written_by_4_processes_restores_with_plain_orbax_onto_another_mesh(
    lost: tuple[Path, Any, list[int]],
) -> None:
    durable = DiskTier(lost[0] / "durable")
    step = durable.steps(timeout=10)[0]
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))  # one process, 2 devices: not the layout that wrote it
    template = init_state(FEATURES, HIDDEN)
    args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, P())), template)
    args["params"]["w1"] = ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, P(None, "x")))
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(durable.path_of(step) / "state", restore_args=args)
    assert restored["params"]["w1"].sharding == NamedSharding(mesh, P(None, "x"))
    ours = durable.restore(step, template, timeout=60).tree  # the manifest-verified read of the same files
    assert compare_states(jax.tree.map(np.asarray, restored), ours, bitwise=True)["match"]


def test_a_damaged_chunk_is_found_by_its_checksum(lost: tuple[Path, Any, list[int]], tmp_path: Path) -> None:
    source = DiskTier(lost[0] / "durable")
    step = source.steps(timeout=10)[0]
    copy = tmp_path / "durable"
    shutil.copytree(source.path_of(step), copy / source.path_of(step).name)
    flip_bit(copy / source.path_of(step).name / "state" / "params.w1" / "0.2")
    template = init_state(FEATURES, HIDDEN)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    shardings = NamedSharding(mesh, P())
    store = ShardedStore(str(copy))
    with pytest.raises(CheckpointInvalid, match=r"params\.w1/0\.2"):
        store.read(step, store.manifest(step), template, shardings)


@pytest.mark.timeout(300)
def test_a_damaged_durable_step_is_withdrawn_and_the_group_restores_the_one_before(tmp_path: Path) -> None:
    result, committed = run(tmp_path / "run", kill=2, damage=10)
    assert result.ok and result.step == STEPS, result.reason
    corrupt = [e for e in read_events(result.events_path) if isinstance(e, CheckpointCorrupt)]
    assert len(corrupt) == 1 and corrupt[0].step == 10 and "params.w1/0.2" in corrupt[0].path
    # Withdrawn (its manifest set aside), then written and committed again by the group that rolled back to 5.
    assert committed.count(10) == 2
    assert restored_steps(result) == [10, 5]  # tried step 10 (damaged), then went back to 5
    assert "durable" in result.recoveries[-1]["restored_from"]
    assert run(tmp_path / "reference", kill=None)[0].ok
    got, want = (DiskTier(d / "final").latest(None).tree for d in (tmp_path / "run", tmp_path / "reference"))
    assert compare_states(got, want, bitwise=True)["match"]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A bucket on the GCS emulator; workers started meanwhile reach it through STORAGE_EMULATOR_HOST."""
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    with running_emulator("durable", log) as emulator, pytest.MonkeyPatch.context() as env:
        env.setenv("STORAGE_EMULATOR_HOST", emulator.url)
        yield "gs://durable/run"


@pytest.mark.timeout(300)
def test_in_gcs_only_the_lost_process_shards_are_read_from_the_bucket(gcs: str, tmp_path: Path) -> None:
    # The emulator serves one request at a time (~70 ms each): a durable step's 4 parts take ~4 s to upload.
    # Slower steps, fewer durable ones, and the host is lost once one is committed.
    result, committed = run(tmp_path / "run", kill=None, durable=gcs, kill_after_commit=10, step_delay_s=0.3, every=10)
    assert result.ok and result.step == STEPS, result.reason
    (recovery,) = result.recoveries
    (restored,) = restored_steps(result)
    assert recovery["restored_from"] == "durable+file" and restored in committed, recovery
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(init_state(FEATURES, HIDDEN)))
    assert whole // 4 <= recovery["bytes_by_tier"]["durable"] <= whole // 4 + 6 * 256, recovery
    # What the 4 processes wrote to the bucket is one checkpoint the GCS tier reads whole, verified.
    store = GcsTier(gcs)
    final = DiskTier(tmp_path / "run" / "final").latest(None).tree
    assert compare_states(store.restore(STEPS, init_state(FEATURES, HIDDEN), timeout=60).tree, final, bitwise=True)[
        "match"
    ]
