"""Worker replicas on /dev/shm (here: a temporary folder) in the disk tier's format: verified, newest-wins."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from gcs_support import small_state
from jax.sharding import NamedSharding, PartitionSpec

from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.boxes import local_like
from elastic_runtime.storage.replicas import (
    MAX_PINS,
    ReplicaFiles,
    device_replica,
    job_fingerprint,
    replica,
    run_identity,
)


def newest_of(files: ReplicaFiles, like: Any, identity: dict[str, str] | None = None, **limits: Any) -> HostSnapshot:
    """The newest replica a restore would take: the newest listed step that reads and verifies; SnapshotUnavailable
    naming what was skipped."""
    for step, tiers in files.listed(identity, **limits).items():
        with contextlib.suppress(CheckpointInvalid):  # each failure is in ``skipped``
            return files.read(step, tiers, like)
    raise SnapshotUnavailable("; ".join(files.skipped) or "none committed")


def test_the_newest_verified_replica_of_any_process_is_read(tmp_path: Path) -> None:
    mine, theirs = ReplicaFiles(tmp_path, "worker-0"), ReplicaFiles(tmp_path, "worker-1")
    try:
        for step in (1, 2, 3):
            mine.save(replica(step, 10 * step, small_state(step)))
        mine.wait()
        theirs.save(replica(4, 40, small_state(4)))
        theirs.wait()
        assert [i.step for i in mine.tier.list(timeout=10)] == [3, 2]  # two kept per process
        newest = newest_of(mine, small_state(0))
        assert mine.skipped == []
        assert (newest.step, newest.data_position) == (4, 40)
        np.testing.assert_array_equal(newest.tree["params"]["w"], small_state(4)["params"]["w"])
        # A damaged replica is detected by its CRC32C and the next newest is read instead.
        victim = next(p for p in theirs.tier.path_of(4).rglob("*") if p.is_file() and p.stat().st_size > 1000)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 1
        victim.write_bytes(bytes(data))
        assert newest_of(mine, small_state(0)).step == 3
        # Another job's state (other shapes) is never taken.
        with pytest.raises(SnapshotUnavailable, match="has no array at"):
            newest_of(mine, {"w": np.zeros(3, np.float32)})
    finally:
        mine.close()
        theirs.close()


def test_a_device_replica_is_copied_to_host_by_its_first_reader(tmp_path: Path) -> None:
    """The worker's RAM replica holds the step's arrays; the replica file's writer makes the host copy."""
    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",)), PartitionSpec(None, "model"))
    whole = np.arange(32, dtype=np.float32).reshape(4, 8)
    state = {"w": jax.device_put(whole, sharding)}
    snapshot = device_replica(3, 30, state, local_like(state, sharding), {"run_id": "r"}, generation=2)
    assert snapshot.nbytes == whole.nbytes and snapshot.metadata == {"run_id": "r", "generation": "2"}
    files = ReplicaFiles(tmp_path, "worker-0")
    try:
        files.save(snapshot)
        files.wait()
        assert isinstance(snapshot.tree["w"], np.ndarray)  # copied once, by the writer
        back = newest_of(files, {"w": np.zeros_like(whole)})
        assert (back.step, back.data_position) == (3, 30)
        np.testing.assert_array_equal(back.tree["w"], whole)
    finally:
        files.close()


def test_a_write_cut_off_before_its_commit_stays_invisible(tmp_path: Path) -> None:
    files = ReplicaFiles(tmp_path, "worker-0")
    try:
        files.save(replica(1, 10, small_state(1)))
        files.wait()

        def crash(step: int) -> None:
            raise OSError("killed mid-write")  # what a kill -9 here would leave: files, no manifest

        files.on_write.append(crash)
        files.save(replica(2, 20, small_state(2)))
        files.wait()  # the failure is logged; the previous replica stays
        assert newest_of(files, small_state(0)).step == 1
    finally:
        files.close()


def test_a_replica_of_another_run_or_job_or_past_the_target_is_skipped_and_named(tmp_path: Path) -> None:
    ours, theirs = run_identity("run-a", small_state(0), 100), run_identity("run-b", small_state(0), 100)
    assert job_fingerprint(small_state(0), 100) != job_fingerprint(small_state(0), 300)  # the target counts
    assert job_fingerprint(small_state(0), 100) != job_fingerprint({"w": np.zeros(3, np.float32)}, 100)
    mine, other = ReplicaFiles(tmp_path, "worker-0"), ReplicaFiles(tmp_path, "worker-1")
    try:
        mine.save(replica(2, 20, small_state(2), ours))
        mine.wait()
        other.save(replica(9, 90, small_state(9), theirs))  # newer, but another run's
        other.wait()
        newest = newest_of(mine, small_state(0), ours)
        assert newest.step == 2 and newest.metadata == ours
        [why] = mine.skipped
        assert "worker-1" in why and "another run's replica" in why and "run-b" in why
        # A step past the target is refused too, even of this run.
        with pytest.raises(SnapshotUnavailable, match="past the target step 1"):
            newest_of(mine, small_state(0), ours, max_step=1)
        # Same run id, other job (a changed script resumed into the same folder): skipped as well.
        changed = run_identity("run-a", small_state(0), 300)
        with pytest.raises(SnapshotUnavailable, match="another job's replica"):
            newest_of(mine, small_state(0), changed)
    finally:
        mine.close()
        other.close()


def test_a_replica_written_by_a_generation_past_its_fence_is_never_restored(tmp_path: Path) -> None:
    # Generation 1 was replaced after step 4 (the group went on from it: fence 4). Its cut-off worker wrote
    # step 9 late; generation 2 wrote steps 5 and 6. The late step 9 is the newest file, and must lose.
    ours = run_identity("run-a", small_state(0), 100)
    cut_off, survivor = ReplicaFiles(tmp_path, "worker-1"), ReplicaFiles(tmp_path, "worker-0")
    try:
        cut_off.save(replica(4, 40, small_state(4), ours, generation=1))
        cut_off.wait()
        cut_off.save(replica(9, 90, small_state(9), ours, generation=1))
        cut_off.wait()
        for step in (5, 6):
            survivor.save(replica(step, 10 * step, small_state(step), ours, generation=2))
            survivor.wait()
        assert newest_of(survivor, small_state(0), ours).step == 9  # without the fences: the late write wins
        newest = newest_of(survivor, small_state(0), ours, fences={1: 4})
        assert newest.step == 6 and newest.metadata == ours | {"generation": "2"}
        [why] = survivor.skipped
        assert "worker-1" in why and why.endswith("written by generation 1 after it was fenced at step 4"), why
        # At or before its fence a generation's replica is part of the run's history: it is restored.
        survivor.tier.delete(5, timeout=10)
        survivor.tier.delete(6, timeout=10)
        assert newest_of(survivor, small_state(0), ours, fences={1: 4}).step == 4
        with pytest.raises(SnapshotUnavailable, match="fenced at step 3"):
            newest_of(survivor, small_state(0), ours, fences={1: 3})
    finally:
        cut_off.close()
        survivor.close()


def test_replicas_of_durable_steps_stay_until_a_newer_durable_step_is_committed(tmp_path: Path) -> None:
    files = ReplicaFiles(tmp_path, "worker-0")
    try:

        def held() -> list[int]:
            files.wait()
            return sorted(i.step for i in files.tier.list(timeout=10))

        for step in range(1, 7):
            files.save(replica(step, step, small_state(step)))
            if step in (2, 4):  # due for a durable write; neither committed yet (the writes lag)
                files.pin(step)
        assert held() == [2, 4, 5, 6]  # the 2 newest, and both pinned steps
        files.committed(4)  # step 4 is the group's newest durable checkpoint: step 2's replica may go
        files.save(replica(7, 7, small_state(7)))
        assert held() == [4, 6, 7]
        for step in range(8, 8 + MAX_PINS + 2):  # a durable tier that never commits: the pins stay bounded
            files.pin(step)
            files.save(replica(step, step, small_state(step)))
        assert held() == list(range(10, 10 + MAX_PINS))  # steps 4 to 9 unpinned and gone
    finally:
        files.close()


def test_listing_reads_only_manifests_and_a_replica_that_fails_its_read_is_never_listed_again(
    tmp_path: Path,
) -> None:
    files = ReplicaFiles(tmp_path, "worker-0")
    try:
        for step in (1, 2):
            files.save(replica(step, 10 * step, small_state(step)))
            files.wait()
        victim = next(p for p in files.tier.path_of(2).rglob("*") if p.is_file() and p.stat().st_size > 1000)
        victim.write_bytes(victim.read_bytes()[:-100])  # truncated: its size no longer matches the manifest
        listed = files.listed()
        assert list(listed) == [2, 1]  # the damage is not seen by listing, which reads no data
        with pytest.raises(CheckpointInvalid) as caught:
            files.read(2, listed[2], small_state(0))
        assert str(victim.relative_to(files.tier.path_of(2))) in caught.value.path + caught.value.reason
        assert any(str(files.tier.path_of(2)) in entry for entry in files.skipped)
        assert list(files.listed()) == [1]
        assert files.read(1, files.listed()[1], small_state(0)).data_position == 10
    finally:
        files.close()
