"""One contract, every durable tier: commit, list, verify, restore, corruption detection, deletion."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest
from gcs_support import BUCKET, small_state
from tests_storage_helpers import snapshot

from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable, StorageError
from elastic_runtime.storage import manifest as mf
from elastic_runtime.storage import pagecache
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.gcs import GcsTier
from elastic_runtime.storage.tier import CheckpointTier

Corrupt = Callable[[int, str, Callable[[bytes], bytes]], None]  # (step, relative path, how)


def same(a: object, b: object) -> None:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.fixture(params=["disk", "gcs", "shm", "packed-on-disk"])
def tier(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[CheckpointTier, Corrupt]]:
    if request.param != "gcs":
        # shm: the /dev/shm mirror's tier, every array in one file (elastic_runtime.storage.packed), nothing fsynced.
        # packed-on-disk: replica files on a disk. What is written is synced every 300 bytes here, in pieces of
        # 100 (256 and 64 MiB in use, storage/pagecache.py), so that a leaf's file is written in pieces.
        packed, sync = request.param != "disk", request.param != "shm"
        monkeypatch.setattr(pagecache, "PIECE_BYTES", 100)
        monkeypatch.setattr(pagecache, "FLUSH_BYTES", 300)
        disk = DiskTier(tmp_path / "ckpt", name=request.param, packed=packed, sync=sync)

        def corrupt_disk(step: int, rel: str, how: Callable[[bytes], bytes]) -> None:
            path = disk.path_of(step) / rel
            path.write_bytes(how(path.read_bytes()))

        yield disk, corrupt_disk
    else:
        uri = request.getfixturevalue("gcs_uri")
        gcs = GcsTier(uri, staging_dir=tmp_path, backoff_s=0)

        def corrupt_gcs(step: int, rel: str, how: Callable[[bytes], bytes]) -> None:
            blob = gcs.client.bucket(BUCKET).blob(gcs._key(step, rel))
            blob.upload_from_string(how(blob.download_as_bytes()))

        yield gcs, corrupt_gcs


def flip_bit(data: bytes) -> bytes:
    at = len(data) // 2
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


def truncate(data: bytes) -> bytes:
    return data[: len(data) - 5]


def biggest_file(t: CheckpointTier, step: int) -> str:
    manifest = t.manifest(step)  # type: ignore[attr-defined]
    return max(manifest.files, key=lambda f: f.size).path


def test_commit_list_restore(tier: tuple[CheckpointTier, Corrupt]) -> None:
    t, _ = tier
    assert t.list(timeout=30) == []
    with pytest.raises(SnapshotUnavailable):
        t.latest(small_state(0))
    for step in (3, 1, 7):
        info = t.save(snapshot(step), timeout=60)
        assert info.step == step and info.nbytes > 0 and info.data_position == 10 * step
    assert [i.step for i in t.list(timeout=30)] == [7, 3, 1]
    restored = t.latest(small_state(0))
    assert (restored.step, restored.data_position) == (7, 70)
    assert restored.metadata == {"mesh": {"data": 8}, "rng": [7, 7], "note": "ok"}
    same(restored.tree, small_state(7))
    # Without a template the tree comes back as plain dicts and lists.
    plain = t.restore(3, None, timeout=60)
    same(plain.tree, small_state(3))
    assert isinstance(plain.tree["opt"], list)
    assert t.verify(1, timeout=30).step == 1


@pytest.mark.parametrize("damage", [flip_bit, truncate], ids=["flipped-bit", "truncated"])
def test_damage_is_detected_never_loaded(
    tier: tuple[CheckpointTier, Corrupt], damage: Callable[[bytes], bytes]
) -> None:
    t, corrupt = tier
    t.save(snapshot(1), timeout=60)
    t.save(snapshot(2), timeout=60)
    bad = biggest_file(t, 2)
    corrupt(2, bad, damage)
    with pytest.raises(CheckpointInvalid) as caught:
        t.verify(2, timeout=30)
    assert bad in caught.value.path
    with pytest.raises(CheckpointInvalid):
        t.restore(2, small_state(0), timeout=60)
    reported: list[tuple[str, CheckpointInvalid]] = []
    t.corruption_listeners.append(lambda name, step, exc: reported.append((name, exc)))
    fallback = t.latest(small_state(0))
    assert fallback.step == 1
    same(fallback.tree, small_state(1))
    assert [name for name, _ in reported] == [t.name] and bad in reported[0][1].path


@pytest.mark.parametrize("tier", ["disk", "gcs"], indirect=True)  # the Orbax layout's small files
def test_small_metadata_file_damage_is_detected(tier: tuple[CheckpointTier, Corrupt]) -> None:
    t, corrupt = tier
    t.save(snapshot(4), timeout=60)
    meta = next(f.path for f in t.manifest(4).files if f.path.endswith(".zarray"))  # type: ignore[attr-defined]
    corrupt(4, meta, lambda b: b.replace(b'"C"', b'"F"'))
    with pytest.raises(CheckpointInvalid):
        t.restore(4, small_state(0), timeout=60)


def test_manifest_naming_a_path_outside_is_rejected(tier: tuple[CheckpointTier, Corrupt]) -> None:
    t, corrupt = tier
    t.save(snapshot(5), timeout=60)

    def escape(data: bytes) -> bytes:
        doc = json.loads(data)
        doc["files"][0]["path"] = "../../etc/passwd"
        return json.dumps(doc).encode()

    corrupt(5, mf.MANIFEST_NAME, escape)
    with pytest.raises(CheckpointInvalid, match="outside the checkpoint"):
        t.restore(5, small_state(0), timeout=60)
    with pytest.raises(CheckpointInvalid):
        t.verify(5, timeout=30)


def test_unparseable_manifest_is_corrupt_not_loaded(tier: tuple[CheckpointTier, Corrupt]) -> None:
    t, corrupt = tier
    t.save(snapshot(6), timeout=60)
    corrupt(6, mf.MANIFEST_NAME, lambda b: b[:-3])
    assert [i.step for i in t.list(timeout=30)] == [6]  # listed, so that verify can name it
    with pytest.raises(CheckpointInvalid):
        t.restore(6, small_state(0), timeout=60)
    with pytest.raises(SnapshotUnavailable):
        t.latest(small_state(0))


def test_other_structure_is_unavailable_not_misloaded(tier: tuple[CheckpointTier, Corrupt]) -> None:
    t, _ = tier
    t.save(snapshot(1), timeout=60)
    other = small_state(0)
    other["params"]["w"] = np.zeros((64, 33), np.float32)  # type: ignore[index]
    with pytest.raises(SnapshotUnavailable, match="holds float32"):
        t.restore(1, other, timeout=60)


def test_delete_removes_manifest_first(tier: tuple[CheckpointTier, Corrupt]) -> None:
    t, _ = tier
    t.save(snapshot(1), timeout=60)
    t.save(snapshot(2), timeout=60)
    t.delete(1, timeout=30)
    assert [i.step for i in t.list(timeout=30)] == [2]
    with pytest.raises(SnapshotUnavailable):
        t.restore(1, None, timeout=30)


def test_disk_partial_write_is_invisible_and_swept(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    disk.save(snapshot(1), timeout=60)
    disk.save(snapshot(2), timeout=60)
    (disk.path_of(2) / mf.MANIFEST_NAME).unlink()  # as if the process died before the commit
    assert [i.step for i in disk.list(timeout=10)] == [1]
    assert disk.latest(small_state(0)).step == 1
    assert disk.sweep() == [disk.path_of(2)]
    assert not disk.path_of(2).exists()


def test_disk_checkpoint_restores_with_plain_orbax(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    info = DiskTier(tmp_path).save(snapshot(9), timeout=60)
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(Path(info.location) / "state")
    same(restored, small_state(9))
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(Path(info.location) / "state")
    same(restored, small_state(9))


def test_disk_save_failure_is_a_storage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="saving step 1"):
        DiskTier(blocker / "ckpt").save(snapshot(1), timeout=30)


def test_direct_writer_writes_what_orbax_writes(tmp_path: Path) -> None:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from elastic_runtime.storage import orbax_layout
    from elastic_runtime.storage.disk import save_orbax

    tree = {
        "params": {"w": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "b": np.ones(3, np.float64)},
        "opt": [np.asarray(5, np.int32), np.asarray([True, False]), np.arange(4, dtype=np.int8), EmptyState()],
        "half": np.asarray(jnp.arange(6, dtype=jnp.bfloat16)),
        "u": np.arange(3, dtype=np.uint16),
        "none": None,  # the empty nodes optax states and user code leave in a state
        "nothing": {"d": {}, "l": [], "t": ()},
    }
    assert orbax_layout.covers(tree)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    entries = orbax_layout.write_tree(ours / "state", tree, root=ours)
    save_orbax(theirs / "state", tree)
    ours_files = sorted(mf.files_under(ours))
    theirs_files = sorted(mf.files_under(theirs))
    assert ours_files == theirs_files == sorted(e.path for e in entries)
    for rel in ours_files:
        if rel.endswith("commit_success.txt"):
            continue  # it names its own directory
        if rel.endswith(".zarray"):
            assert json.loads((ours / rel).read_bytes()) == json.loads((theirs / rel).read_bytes()), rel
        elif "/_" not in rel:  # chunk files: the same bytes
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
    ours_meta = json.loads((ours / "state" / "_METADATA").read_text())
    assert ours_meta == json.loads((theirs / "state" / "_METADATA").read_text())
    for entry in entries:
        assert mf.crc32c_file(ours / entry.path) == (entry.size, entry.crc32c)
    with ocp.PyTreeCheckpointer() as checkpointer:
        same(checkpointer.restore(ours / "state"), tree)
        restored = checkpointer.restore(ours / "state", item=tree)  # the state itself as the target tree
        assert jax.tree.structure(restored) == jax.tree.structure(tree)
        same(restored, tree)


class EmptyState(NamedTuple):
    """As optax's: a state node with no arrays."""


def test_disk_symlink_out_of_the_checkpoint_is_rejected(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "ckpt")
    disk.save(snapshot(1), timeout=30)
    entry = max(disk.manifest(1).files, key=lambda f: f.size)
    outside = tmp_path / "elsewhere"
    outside.write_bytes((disk.path_of(1) / entry.path).read_bytes())  # even the right bytes
    (disk.path_of(1) / entry.path).unlink()
    (disk.path_of(1) / entry.path).symlink_to(outside)
    with pytest.raises(CheckpointInvalid, match="resolves outside"):
        disk.restore(1, None, timeout=30)
    with pytest.raises(CheckpointInvalid, match="resolves outside"):
        disk.verify(1, timeout=30)


def test_templates_may_be_abstract_or_python_scalars(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    disk.save(snapshot(2), timeout=30)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), small_state(0))
    same(disk.restore(2, abstract, timeout=30).tree, small_state(2))
    scalar_like = small_state(0)
    scalar_like["opt"][1] = 0  # type: ignore[index]  # a Python int where the job keeps a counter
    restored = disk.restore(2, scalar_like, timeout=30)
    assert restored.tree["opt"][1] == 2
