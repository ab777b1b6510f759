"""One restore routine: the newest step any tier holds that verifies, from the fastest tier holding it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gcs_support import small_state
from tests_storage_helpers import snapshot

from runtime.core.errors import CheckpointInvalid, SnapshotUnavailable
from runtime.core.restore import restore_newest
from runtime.core.snapshot import RamTier
from storage.disk import DiskTier


def ram_holding(step: int) -> RamTier:
    ram = RamTier()
    ram.commit(small_state(step), step=step, data_position=10 * step, metadata={})
    return ram


def test_the_newest_step_wins_over_the_fastest_tier(tmp_path: Path) -> None:
    ram, disk = ram_holding(5), DiskTier(tmp_path / "disk")
    disk.save(snapshot(7), timeout=30)
    try:
        source, restored = restore_newest([ram, disk], timeout=30)
        assert (source.name, restored.step, restored.data_position) == ("disk", 7, 70)
        np.testing.assert_array_equal(restored.tree["params"]["w"], small_state(7)["params"]["w"])
    finally:
        ram.close()


def test_among_equal_steps_the_fastest_tier_is_read(tmp_path: Path) -> None:
    ram, disk = ram_holding(7), DiskTier(tmp_path / "disk")
    disk.save(snapshot(7), timeout=30)
    try:
        source, restored = restore_newest([ram, disk], timeout=30)
        assert (source.name, restored.step) == ("ram", 7)
    finally:
        ram.close()


def test_a_corrupt_checkpoint_is_reported_and_the_same_step_comes_from_a_slower_tier(tmp_path: Path) -> None:
    shm, disk = DiskTier(tmp_path / "shm", name="shm"), DiskTier(tmp_path / "disk")
    for tier in (shm, disk):
        tier.save(snapshot(4), timeout=30)
        tier.save(snapshot(9), timeout=30)
    victim = next(p for p in shm.path_of(9).rglob("*") if p.is_file() and p.stat().st_size > 1000)  # an array
    victim.write_bytes(victim.read_bytes()[:-5])
    reported: list[tuple[str, int, CheckpointInvalid]] = []
    shm.corruption_listeners.append(lambda name, step, exc: reported.append((name, step, exc)))
    source, restored = restore_newest([shm, disk], timeout=30)
    assert (source.name, restored.step) == ("disk", 9)
    assert [(name, step) for name, step, _ in reported] == [("shm", 9)]


def test_nothing_restorable_names_every_tier(tmp_path: Path) -> None:
    ram = RamTier()
    try:
        with pytest.raises(SnapshotUnavailable, match="ram, disk"):
            restore_newest([ram, DiskTier(tmp_path / "disk")], timeout=5)
    finally:
        ram.close()
