"""The cascade inside a real run: cadence, events, requests, retention, busy tiers, a full disk, restore onto a
smaller mesh, and the newest verified step across tiers."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import jax
import numpy as np
import pytest
from gcs_support import client_for
from tests_storage_helpers import snapshot

from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig, read_events
from elastic_runtime.core.context import RuntimeContext
from elastic_runtime.core.errors import ConfigError, StorageError
from elastic_runtime.core.events import (
    CheckpointBehind,
    CheckpointCommitted,
    CheckpointCorrupt,
    CheckpointFailed,
    CheckpointSkipped,
    Event,
    RunFinished,
    RunStarted,
    StateRestored,
    StepCompleted,
)
from elastic_runtime.core.job import TrainJob
from elastic_runtime.core.restore import restore_newest
from elastic_runtime.core.snapshot import HostSnapshot, RamTier
from elastic_runtime.storage.cascade import TieredCheckpointer
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.gcs import GcsTier
from elastic_runtime.testing.demo_model import demo_job
from elastic_runtime.testing.faultproxy import FaultProxy

MESH = {"data": 4, "model": 2}


def job() -> TrainJob:
    return demo_job(global_batch=32, features=32, hidden=256)


def config(tmp_path: Path, **overrides: object) -> RuntimeConfig:
    values: dict[str, object] = {"run_dir": str(tmp_path / "run"), "scale_up_poll_s": None, "precompile": False}
    values.update(overrides)
    return RuntimeConfig(**values)  # type: ignore[arg-type]


def events_of(path: str | None, kind: type[Event]) -> list[Event]:
    assert path is not None
    return [e for e in read_events(path) if isinstance(e, kind)]


def test_runtime_promotes_snapshots_to_disk_with_retention(tmp_path: Path) -> None:
    rt = ElasticRuntime(job(), config=config(tmp_path, disk_every=4, keep=2), mesh_policy=MeshPolicy(MESH))
    assert rt.checkpointer is not None and rt.checkpointer.disk is not None
    assert [s.name for s in rt.executor.restore_sources] == ["ram", "disk"]
    result = rt.run(14)
    committed = events_of(result.events_path, CheckpointCommitted)
    assert committed and all(e.tier == "disk" and e.bytes > 0 for e in committed)  # type: ignore[attr-defined]
    assert committed[-1].step == 14  # the final step is committed when the run ends
    steps = [i.step for i in rt.checkpointer.disk.list(timeout=10)]
    assert len(steps) == 2 and steps[0] == 14  # keep=2, the newest among them
    restored = rt.checkpointer.disk.latest(job().init())
    assert restored.step == 14 and restored.data_position == result.data_position
    for a, b in zip(jax.tree.leaves(restored.tree), jax.tree.leaves(result.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_save_request_commits_off_cadence(tmp_path: Path) -> None:
    rt = ElasticRuntime(
        job(),
        config=config(tmp_path, disk_every=1000, checkpoint_on_finish=False),
        mesh_policy=MeshPolicy(MESH),
    )

    @rt.on(StepCompleted)
    async def ask(event: StepCompleted, ctx: RuntimeContext) -> None:
        if event.step == 5:
            await ctx.request_checkpoint(reason="maintenance notice")

    result = rt.run(12)
    assert rt.checkpointer is not None
    rt.checkpointer.wait(30)
    committed = [e for e in events_of(result.events_path, CheckpointCommitted)]
    assert len(committed) == 1 and 5 <= (committed[0].step or 0) <= 12


def test_a_busy_tier_writes_its_newest_due_save_next_and_says_how_far_behind_it_is(
    tmp_path: Path, gcs_uri: str, gcs_emulator: object
) -> None:
    # Every request through this proxy is held 0.12 s: an upload of ~15 files takes far longer than a step.
    with FaultProxy(("127.0.0.1", gcs_emulator.port), rate=1.0, faults=("slow",), slow_s=0.12) as slow:  # type: ignore[attr-defined]
        rt = ElasticRuntime(job(), config=config(tmp_path, checkpoint_dir=""), mesh_policy=MeshPolicy(MESH))
        assert rt.checkpointer is None
        gcs = GcsTier(gcs_uri, client=client_for(slow.url), workers=2)
        checkpointer = TieredCheckpointer(
            rt.executor.ram, disk=DiskTier(tmp_path / "disk"), gcs=gcs, disk_every=1, gcs_every=1, keep=2
        ).attach(rt)
        assert [s.name for s in rt.executor.restore_sources] == ["ram", "disk", "gcs"]

        async def pace(next_step: int) -> None:
            await anyio.sleep(0.05)  # steps slower than a disk save, far faster than an upload

        rt.at_step_boundary(pace)

        result = rt.run(30)
    skipped = events_of(result.events_path, CheckpointSkipped)
    assert any(e.tier == "gcs" for e in skipped)  # type: ignore[attr-defined]  # replaced while waiting
    behind = {e.step: e for e in events_of(result.events_path, CheckpointBehind) if e.tier == "gcs"}  # type: ignore[attr-defined]
    assert behind and all(e.writing < step and e.behind_steps >= step - e.writing for step, e in behind.items())  # type: ignore[attr-defined]
    gcs_commits = [e for e in events_of(result.events_path, CheckpointCommitted) if e.tier == "gcs"]  # type: ignore[attr-defined]
    assert 2 <= len(gcs_commits) < 30
    # A due upload that waited was uploaded when the one before it ended (not dropped until the next due one).
    assert {e.step for e in gcs_commits} & set(behind)
    assert gcs_commits[-1].step == 30  # the final step still reaches GCS
    assert gcs.latest(job().init()).step == 30
    assert not checkpointer.status()["gcs_running"]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 1.5 MB tmpfs: writes past it fail with ENOSPC, as on a full disk."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_fails_the_save_not_the_run(tmp_path: Path, tiny_tmpfs: Path) -> None:
    # ~530 KB per checkpoint: two fit in 1.5 MB, the third does not.
    big = demo_job(global_batch=32, features=64, hidden=1024)
    rt = ElasticRuntime(
        big,
        config=config(tmp_path, checkpoint_dir=str(tiny_tmpfs), disk_every=2, keep=10),
        mesh_policy=MeshPolicy(MESH),
    )

    async def pace(next_step: int) -> None:
        # Before each step, let the previous step's snapshot reach the disk: one save per cadence, none skipped.
        assert rt.checkpointer is not None
        checkpointer = rt.checkpointer

        await anyio.to_thread.run_sync(checkpointer.wait, 30)

    rt.at_step_boundary(pace)
    result = rt.run(10)
    assert result.step == 10
    finished = events_of(result.events_path, RunFinished)
    assert finished[-1].ok  # type: ignore[attr-defined]
    failed = events_of(result.events_path, CheckpointFailed)
    assert failed and all("no space left" in e.reason for e in failed)  # type: ignore[attr-defined]
    assert rt.checkpointer is not None and rt.checkpointer.disk is not None
    intact = [i.step for i in rt.checkpointer.disk.list(timeout=10)]
    assert intact == [4, 2]
    for step in intact:
        rt.checkpointer.disk.verify(step, timeout=10)
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["step_0000000002", "step_0000000004"]


def test_enospc_mid_write_leaves_older_checkpoints_intact(tiny_tmpfs: Path) -> None:
    disk = DiskTier(tiny_tmpfs, check_space=False)  # no early refusal: the write itself runs out of space
    state = {"w": np.ones((256, 1024), np.float32)}  # 1 MB: one fits in the 1.5 MB tmpfs, two do not
    disk.save(HostSnapshot(step=1, data_position=1, tree=state, nbytes=0, seconds=0.0, metadata={}), timeout=30)
    with pytest.raises(StorageError, match="no space left on device"):
        disk.save(HostSnapshot(step=2, data_position=2, tree=state, nbytes=0, seconds=0.0, metadata={}), timeout=30)
    assert [i.step for i in disk.list(timeout=10)] == [1]
    disk.verify(1, timeout=10)
    assert [p.name for p in tiny_tmpfs.iterdir()] == ["step_0000000001"]  # the torn write was removed


def test_restore_onto_a_smaller_mesh(tmp_path: Path) -> None:
    first = ElasticRuntime(job(), config=config(tmp_path, disk_every=5), mesh_policy=MeshPolicy(MESH))
    saved = first.run(10)
    # A new runtime (as after a restart) on 4 of the 8 devices, resuming from the disk tier.
    small = MeshPolicy({"data": 2, "model": 2})
    second = ElasticRuntime(job(), config=config(tmp_path, disk_every=5), mesh_policy=small)
    resumed = second.run(16, resume=True)
    restored = events_of(resumed.events_path, StateRestored)
    assert restored[0].restored_from == "disk" and restored[0].step == 10  # type: ignore[attr-defined]
    assert second.executor.mesh is not None and second.executor.mesh.devices.size == 4
    reference = ElasticRuntime(job(), config=config(tmp_path / "ref", checkpoint_dir=""), mesh_policy=MeshPolicy(MESH))
    expected = reference.run(16)
    assert saved.data_position == 10 and resumed.data_position == expected.data_position == 16
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(expected.state), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def newest(checkpointer: TieredCheckpointer, like: Any) -> tuple[str, HostSnapshot]:
    """The newest step that verifies in any of the checkpointer's durable tiers, and the tier it came from."""
    tier, snap = restore_newest(checkpointer.restore_tiers, like, timeout=300)
    return tier.name, snap


def test_newest_verified_step_across_tiers(tmp_path: Path, gcs_uri: str) -> None:
    disk = DiskTier(tmp_path / "disk")
    gcs = GcsTier(gcs_uri, staging_dir=tmp_path)
    checkpointer = TieredCheckpointer(RamTier(), disk=disk, gcs=gcs)
    for step in (5, 10):
        info = disk.save(snapshot(step), timeout=30)
        gcs.upload(info.location, timeout=30)
    disk.delete(5, timeout=10)
    like = snapshot(0).tree
    tier, snap = newest(checkpointer, like)
    assert (tier, snap.step) == ("disk", 10)  # fastest first
    bad = max(disk.manifest(10).files, key=lambda f: f.size).path
    path = disk.path_of(10) / bad
    path.write_bytes(path.read_bytes()[:-1])
    tier, snap = newest(checkpointer, like)
    assert (tier, snap.step) == ("gcs", 10)  # same step from the slower tier beats an older one
    corrupt = [e for e in checkpointer.take_events() if isinstance(e, CheckpointCorrupt)]
    assert len(corrupt) == 1 and corrupt[0].tier == "disk" and bad in corrupt[0].path and corrupt[0].step == 10
    gcs.delete(10, timeout=10)
    disk.save(snapshot(7), timeout=30)
    tier, snap = newest(checkpointer, like)
    assert (tier, snap.step) == ("disk", 7)


def test_ram_dir_mirror_survives_a_restart(tmp_path: Path) -> None:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    ram_dir = shm / f"elastic-runtime-test-{uuid.uuid4().hex[:8]}"
    try:
        first = ElasticRuntime(
            job(), config=config(tmp_path, ram_dir=str(ram_dir), checkpoint_dir=""), mesh_policy=MeshPolicy(MESH)
        )
        assert [s.name for s in first.executor.restore_sources] == ["ram", "shm"]

        async def settle(next_step: int) -> None:
            assert first.checkpointer is not None
            await anyio.to_thread.run_sync(first.checkpointer.wait, 30)

        first.at_step_boundary(settle)
        saved = first.run(9)
        assert first.checkpointer is not None
        first.checkpointer.wait(30)
        assert first.checkpointer.shm is not None
        assert len(first.checkpointer.shm.list(timeout=10)) == 2  # the mirror keeps two copies
        # A new process (here: a new runtime with an empty RAM tier) finds the newest snapshot in the mirror.
        second = ElasticRuntime(
            job(), config=config(tmp_path / "2", ram_dir=str(ram_dir), checkpoint_dir=""), mesh_policy=MeshPolicy(MESH)
        )
        resumed = second.run(9, resume=True)
        restored = events_of(resumed.events_path, StateRestored)
        assert restored[0].restored_from == "shm" and restored[0].step == 9  # type: ignore[attr-defined]
        for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(saved.state), strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        shutil.rmtree(ram_dir, ignore_errors=True)


def test_corrupt_newest_disk_checkpoint_falls_back_with_an_event(tmp_path: Path) -> None:
    first = ElasticRuntime(job(), config=config(tmp_path, disk_every=5, keep=5), mesh_policy=MeshPolicy(MESH))
    first.run(10)
    assert first.checkpointer is not None and first.checkpointer.disk is not None
    disk = first.checkpointer.disk
    assert [i.step for i in disk.list(timeout=10)] == [10, 5]
    bad = disk.path_of(10) / max(disk.manifest(10).files, key=lambda f: f.size).path
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    second = ElasticRuntime(
        job(), config=config(tmp_path / "2", checkpoint_dir=str(disk.root)), mesh_policy=MeshPolicy(MESH)
    )
    result = second.run(12, resume=True)
    corrupt = events_of(result.events_path, CheckpointCorrupt)
    assert len(corrupt) == 1 and corrupt[0].tier == "disk" and str(bad) == corrupt[0].path  # type: ignore[attr-defined]
    restored = events_of(result.events_path, StateRestored)
    assert restored[0].step == 5 and restored[0].restored_from == "disk"  # type: ignore[attr-defined]


def test_save_request_to_gcs_goes_through_disk_and_unknown_tiers_are_skipped(tmp_path: Path, gcs_uri: str) -> None:
    cfg = config(tmp_path, disk_every=1000, gcs_every=1000, gcs_uri=gcs_uri, checkpoint_on_finish=False)
    rt = ElasticRuntime(job(), config=cfg, mesh_policy=MeshPolicy(MESH))

    @rt.on(StepCompleted)
    async def ask(event: StepCompleted, ctx: RuntimeContext) -> None:
        if event.step == 4:
            await ctx.request_checkpoint(tiers=("gcs", "tape"), reason="preemption notice")

    async def settle(next_step: int) -> None:
        if next_step == 9:  # let the request land before the run ends
            assert rt.checkpointer is not None
            await anyio.sleep(0.2)
            await anyio.to_thread.run_sync(rt.checkpointer.wait, 60)

    rt.at_step_boundary(settle)
    result = rt.run(10)
    committed = events_of(result.events_path, CheckpointCommitted)
    assert [e.tier for e in committed] == ["disk", "gcs"]  # type: ignore[attr-defined]
    assert committed[0].step == committed[1].step
    skipped = events_of(result.events_path, CheckpointSkipped)
    assert [(e.tier, e.reason) for e in skipped] == [("tape", "no such tier")]  # type: ignore[attr-defined]


def test_a_run_folder_with_checkpoints_resumes_only_when_asked(tmp_path: Path) -> None:
    ElasticRuntime(job(), config=config(tmp_path, disk_every=4), mesh_policy=MeshPolicy(MESH)).run(10)
    again = ElasticRuntime(job(), config=config(tmp_path, disk_every=4), mesh_policy=MeshPolicy(MESH))
    with pytest.raises(ConfigError, match=r"disk up to step 10.*resume=True"):
        again.run(20)
    resumed_rt = ElasticRuntime(job(), config=config(tmp_path, disk_every=4), mesh_policy=MeshPolicy(MESH))
    resumed = resumed_rt.run(20, resume=True)
    events = read_events(tmp_path / "run" / "events.jsonl")
    last_start = max(i for i, e in enumerate(events) if isinstance(e, RunStarted))
    tail = events[last_start:]
    assert tail[0].step == 10  # type: ignore[attr-defined]
    restored = [e for e in tail if isinstance(e, StateRestored)]
    assert [(e.step, e.restored_from, e.lost_steps) for e in restored] == [(10, "disk", 0)]
    commits = [e.step for e in tail if isinstance(e, StepCompleted)]
    assert commits == list(range(11, 21))  # the first process's steps are not run again
    due = sorted({e.step for e in tail if isinstance(e, CheckpointCommitted | CheckpointSkipped) and e.tier == "disk"})
    assert due == [12, 16, 20]  # the cadence counts on from step 10: nothing due at once at step 11
    reference = ElasticRuntime(job(), config=config(tmp_path / "ref", checkpoint_dir=""), mesh_policy=MeshPolicy(MESH))
    expected = reference.run(20)
    assert resumed.step == 20 and resumed.data_position == 20
    for a, b in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(expected.state), strict=True):
        np.testing.assert_array_equal(a, b)
    beyond = ElasticRuntime(job(), config=config(tmp_path, disk_every=4), mesh_policy=MeshPolicy(MESH))
    with pytest.raises(ConfigError, match="step 20, beyond the target 15"):
        beyond.run(15, resume=True)
