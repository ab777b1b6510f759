"""One restore routine: a given step from the first of its tiers that verifies, and the newest step any tier holds
that verifies, from the fastest tier holding it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gcs_support import small_state
from tests_storage_helpers import snapshot

from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable
from elastic_runtime.core.restore import restore_newest, restore_step
from elastic_runtime.core.snapshot import RamTier
from elastic_runtime.storage.disk import DiskTier


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


def damage(tier: DiskTier, step: int) -> None:
    victim = next(p for p in tier.path_of(step).rglob("*") if p.is_file() and p.stat().st_size > 1000)  # an array
    victim.write_bytes(victim.read_bytes()[:-5])


def test_a_given_step_comes_from_the_first_tier_that_verifies_and_the_damaged_one_is_reported(tmp_path: Path) -> None:
    shm, disk = DiskTier(tmp_path / "shm", name="shm"), DiskTier(tmp_path / "disk")
    for tier in (shm, disk):
        tier.save(snapshot(4), timeout=30)
        tier.save(snapshot(9), timeout=30)
    damage(shm, 4)
    reported: list[tuple[str, int]] = []
    shm.corruption_listeners.append(lambda name, step, exc: reported.append((name, step)))
    source, restored = restore_step([shm, disk], 4, timeout=30)  # an older step than the newest: as asked
    assert (source.name, restored.step, restored.data_position) == ("disk", 4, 40)
    assert reported == [("shm", 4)]


def test_a_step_damaged_everywhere_raises_checkpoint_invalid_naming_each_tier(tmp_path: Path) -> None:
    shm, disk = DiskTier(tmp_path / "shm", name="shm"), DiskTier(tmp_path / "disk")
    for tier in (shm, disk):
        tier.save(snapshot(4), timeout=30)
        damage(tier, 4)
    with pytest.raises(CheckpointInvalid, match=r"shm step 4: .*; disk step 4: ") as raised:
        restore_step([shm, disk], 4, timeout=30)
    assert raised.value.path.startswith(str(disk.path_of(4)))  # the last one tried


def test_a_step_no_tier_holds_is_unavailable_not_invalid(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk")
    disk.save(snapshot(4), timeout=30)
    with pytest.raises(SnapshotUnavailable, match="disk step 5"):
        restore_step([disk], 5, timeout=30)
