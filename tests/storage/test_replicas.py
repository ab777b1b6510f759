"""Worker replicas on /dev/shm (here: a temporary folder) in the disk tier's format: verified, newest-wins."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gcs_support import small_state

from runtime.core.errors import SnapshotUnavailable
from storage.replicas import ReplicaFiles, replica


def test_the_newest_verified_replica_of_any_process_is_read(tmp_path: Path) -> None:
    mine, theirs = ReplicaFiles(tmp_path, "worker-0"), ReplicaFiles(tmp_path, "worker-1")
    try:
        for step in (1, 2, 3):
            mine.save(replica(step, 10 * step, small_state(step)))
        mine.wait()
        theirs.save(replica(4, 40, small_state(4)))
        theirs.wait()
        assert [i.step for i in mine.tier.list(timeout=10)] == [3, 2]  # two kept per process
        newest = mine.newest(small_state(0))
        assert (newest.step, newest.data_position) == (4, 40)
        np.testing.assert_array_equal(newest.tree["params"]["w"], small_state(4)["params"]["w"])
        # A damaged replica is detected by its CRC32C and the next newest is read instead.
        victim = next(p for p in theirs.tier.path_of(4).rglob("*") if p.is_file() and p.stat().st_size > 1000)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 1
        victim.write_bytes(bytes(data))
        assert mine.newest(small_state(0)).step == 3
        # Another job's state (other shapes) is never taken.
        with pytest.raises(SnapshotUnavailable, match="no usable replica"):
            mine.newest({"w": np.zeros(3, np.float32)})
    finally:
        mine.close()
        theirs.close()


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
        assert files.newest(small_state(0)).step == 1
    finally:
        files.close()
