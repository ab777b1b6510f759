"""The persistent-disk tier: committed checkpoints in Orbax format on a local directory.

Layout (one directory per step; ``plain orbax.checkpoint`` restores ``<step>/state`` without this library)::

    ROOT/step_0000000120/state/...       an Orbax PyTree checkpoint (zarr2, uncompressed, no OCDBT)
    ROOT/step_0000000120/manifest.json   written last: rename of a fsynced temporary file

Commit: the arrays are written in Orbax's own layout (:mod:`elastic_runtime.storage.orbax_layout` writes it directly,
one sequential fsynced write per array, CRC32C taken from memory; trees it does not cover go through Orbax), then
the manifest goes to a temporary name, is fsynced, renamed into place, and the directory is fsynced. A crash at
any instant leaves either the complete checkpoint or a directory without a manifest, which no reader lists and
the next save sweeps away.

Restore reads every file back checked against the manifest (:mod:`elastic_runtime.storage.checked_read`).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable, StorageError
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage import manifest as mf
from elastic_runtime.storage import orbax_layout, packed
from elastic_runtime.storage.checked_read import LAYOUT, STATE_DIR, Deadline, load_directory, verify_directory
from elastic_runtime.storage.manifest import FileEntry, Manifest
from elastic_runtime.storage.tier import CheckpointInfo, CorruptionListener, PyTree, latest_verified, snapshot_from

log = logging.getLogger(__name__)


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: Manifest, *, sync: bool = True) -> None:
    """Commit ``directory``: write the manifest to a temporary name, fsync, rename into place, fsync the dir."""
    tmp = directory / f".{mf.MANIFEST_NAME}.tmp"
    with open(tmp, "wb") as f:
        f.write(mf.encode(manifest))
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, directory / mf.MANIFEST_NAME)
    if sync:
        _fsync_path(directory, directory=True)


def read_manifest(directory: Path) -> Manifest:
    """Read and check ``directory``'s manifest.

    Raises:
        SnapshotUnavailable: there is no manifest (the checkpoint was never committed).
        CheckpointInvalid: the manifest does not parse or names a path outside the checkpoint.
    """
    path = directory / mf.MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise SnapshotUnavailable(f"{directory} holds no committed checkpoint (no {mf.MANIFEST_NAME})") from exc
    except OSError as exc:
        raise CheckpointInvalid(f"cannot read {path}: {exc}", path=str(path), reason=str(exc)) from exc
    return mf.decode(data, where=str(path))


def save_orbax(state_dir: Path, tree: PyTree) -> None:
    """Write ``tree`` (numpy arrays) as a plain Orbax PyTree checkpoint, uncompressed and without OCDBT.

    Uncompressed: on a local disk compression costs more CPU time than it saves in I/O, and it lets the
    restore read chunks straight into place. No OCDBT: one file per array, so the manifest can name and
    checksum each one.
    """
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(state_dir, args=ocp.args.PyTreeSave(tree))


class DiskTier:
    """Checkpoints in Orbax format under ``root``, one directory per step, committed by their manifest.

    Args:
        root: the checkpoint directory (created if missing).
        name: the tier's name in events and restore sources.
        check_space: refuse a save up front when the file system has less free space than the snapshot needs,
            rather than filling it to the last byte (which also hurts everything else writing there).
        packed: write every array into one file (:mod:`elastic_runtime.storage.packed`) rather than Orbax's
            layout, which plain Orbax cannot read but costs one write instead of hundreds; for the ``/dev/shm``
            mirror.
        sync: fsync what is written (off only where an fsync protects nothing, as on ``/dev/shm``: a tmpfs
            lives no longer than the host's power, and a process crash loses nothing the kernel holds).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        name: str = "disk",
        check_space: bool = True,
        packed: bool = False,
        sync: bool = True,
    ) -> None:
        self.root = Path(root)
        self.name = name
        self.check_space = check_space
        self.packed = packed
        self.sync = sync
        self.corruption_listeners: list[CorruptionListener] = []
        # Called with the step once its files are written, before the manifest commits them: what a crash
        # there leaves must stay invisible (the crash tests use it).
        self.before_commit: list[Callable[[int], None]] = []

    def path_of(self, step: int) -> Path:
        """The folder that holds (or will hold) the checkpoint of ``step``."""
        return self.root / mf.step_dirname(step)

    # --- writing -------------------------------------------------------------------------------------

    def save(self, snapshot: HostSnapshot, *, timeout: float) -> CheckpointInfo:
        """Write and commit ``snapshot``.

        Raises:
            StorageError: the write failed (disk full, I/O error, timeout); the partial directory is removed
                when possible and is invisible either way; older checkpoints are untouched.
        """
        deadline = Deadline(timeout, f"{self.name}: saving step {snapshot.step} to {self.root}")
        directory = self.path_of(snapshot.step)
        try:
            if (directory / mf.MANIFEST_NAME).exists():
                return self._info(directory, read_manifest(directory))  # already committed: saving is idempotent
            self.root.mkdir(parents=True, exist_ok=True)
            if directory.exists():
                shutil.rmtree(directory)  # a torn earlier attempt at the same step
            directory.mkdir()
            if self.check_space:
                _require_space(directory, snapshot)
            files = None
            if self.packed:
                files = packed.write_tree(directory, snapshot.tree, sync=self.sync)
            elif orbax_layout.covers(snapshot.tree):
                files = orbax_layout.write_tree(directory / STATE_DIR, snapshot.tree, root=directory, sync=self.sync)
            else:
                save_orbax(directory / STATE_DIR, snapshot.tree)
            deadline.check()
            manifest = self._describe(directory, snapshot, deadline, files)
            for listener in self.before_commit:
                listener(snapshot.step)
            write_manifest(directory, manifest, sync=self.sync)
            if self.sync:
                _fsync_path(self.root, directory=True)
        except StorageError as exc:
            self._discard(directory)
            raise StorageError(f"{self.name}: saving step {snapshot.step} to {directory} failed: {exc}") from exc
        except Exception as exc:  # tensorstore and Orbax report I/O errors as ValueError and friends
            self._discard(directory)
            raise StorageError(f"{self.name}: saving step {snapshot.step} to {directory} failed: {_why(exc)}") from exc
        return self._info(directory, manifest)

    def _describe(
        self, directory: Path, snapshot: HostSnapshot, deadline: Deadline, files: list[FileEntry] | None
    ) -> Manifest:
        structure, leaves = mf.describe_leaves(snapshot.tree)
        if files is None:  # written by Orbax: checksum the files as they lie on disk
            files = []
            for rel in sorted(mf.files_under(directory)):
                deadline.check()
                size, crc = mf.crc32c_file(directory / rel)
                files.append(FileEntry(path=rel, size=size, crc32c=crc))
        return Manifest(
            step=snapshot.step,
            data_position=snapshot.data_position,
            layout=packed.LAYOUT if self.packed else LAYOUT,
            structure=structure,
            leaves=leaves,
            files=tuple(sorted(files, key=lambda f: f.path)),
            metadata=dict(snapshot.metadata),
        )

    def _discard(self, directory: Path) -> None:
        if (directory / mf.MANIFEST_NAME).exists():
            return  # committed after all (the failure came later): keep it
        shutil.rmtree(directory, ignore_errors=True)

    def sweep(self, *, keep_step: int | None = None) -> list[Path]:
        """Remove directories that never committed (a crash mid-write), except ``keep_step``'s. One writer only."""
        removed: list[Path] = []
        if not self.root.is_dir():
            return removed
        for child in self.root.iterdir():
            step = mf.parse_step_dirname(child.name)
            if step is None or step == keep_step or (child / mf.MANIFEST_NAME).exists():
                continue
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
        return removed

    def delete(self, step: int, *, timeout: float) -> None:
        """Remove ``step``: manifest first (the checkpoint vanishes at once), then its data."""
        directory = self.path_of(step)
        try:
            (directory / mf.MANIFEST_NAME).unlink(missing_ok=True)
            if self.sync:
                _fsync_path(directory, directory=True)
            shutil.rmtree(directory)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"{self.name}: deleting step {step} at {directory} failed: {exc}") from exc

    # --- reading -------------------------------------------------------------------------------------

    def steps(self, *, timeout: float) -> list[int]:
        """The committed steps, newest first."""
        return [info.step for info in self.list(timeout=timeout)]

    def list(self, *, timeout: float) -> list[CheckpointInfo]:
        """Committed checkpoints, newest first. A manifest that does not parse is listed with ``nbytes=-1``."""
        if not self.root.is_dir():
            return []
        found = []
        try:
            for child in self.root.iterdir():
                step = mf.parse_step_dirname(child.name)
                if step is None or not (child / mf.MANIFEST_NAME).exists():
                    continue
                try:
                    found.append(self._info(child, read_manifest(child)))
                except (CheckpointInvalid, SnapshotUnavailable):
                    found.append(CheckpointInfo(self.name, step, str(child), -1, -1, 0.0, 0))
        except OSError as exc:
            raise StorageError(f"{self.name}: cannot list {self.root}: {exc}") from exc
        return sorted(found, key=lambda info: info.step, reverse=True)

    def manifest(self, step: int) -> Manifest:
        """``step``'s manifest. Raises SnapshotUnavailable (not committed) or CheckpointInvalid."""
        return read_manifest(self.path_of(step))

    def verify(self, step: int, *, timeout: float) -> CheckpointInfo:
        """Check every file of ``step``. Raises CheckpointInvalid naming the bad file, or SnapshotUnavailable."""
        directory = self.path_of(step)
        manifest = read_manifest(directory)
        verify_directory(directory, manifest, Deadline(timeout, f"{self.name}: verifying step {step}"))
        return self._info(directory, manifest)

    def restore(self, step: int, like: PyTree = None, *, timeout: float) -> HostSnapshot:
        """Load ``step``, verifying every file. Raises CheckpointInvalid, SnapshotUnavailable or StorageError."""
        started = time.monotonic()
        directory = self.path_of(step)
        manifest = read_manifest(directory)
        tree = load_directory(directory, manifest, like, Deadline(timeout, f"{self.name}: restoring step {step}"))
        return snapshot_from(manifest, tree, time.monotonic() - started, where=str(directory))

    def latest(self, like: PyTree = None, timeout: float | None = 30.0) -> HostSnapshot:
        """The newest checkpoint that verifies (see :func:`elastic_runtime.storage.tier.latest_verified`)."""
        return latest_verified(self, like, timeout)

    def _info(self, directory: Path, manifest: Manifest) -> CheckpointInfo:
        return CheckpointInfo(
            tier=self.name,
            step=manifest.step,
            location=str(directory),
            nbytes=manifest.nbytes,
            data_position=manifest.data_position,
            created=manifest.created,
            files=len(manifest.files),
        )


def _require_space(directory: Path, snapshot: HostSnapshot) -> None:
    need = snapshot.nbytes or sum(int(np.asarray(x).nbytes) for x in _leaves(snapshot.tree))
    need += max(64 << 10, need // 100)  # Orbax's metadata files and file-system overhead
    free = shutil.disk_usage(directory).free
    if free < need:
        raise StorageError(
            f"no space left on device: {free} bytes free in {directory.parent}, step {snapshot.step} needs ~{need}"
        )


def _leaves(tree: PyTree) -> list[Any]:
    import jax

    return list(jax.tree.leaves(tree))


def _why(exc: BaseException) -> str:
    """A one-line reason, naming ENOSPC plainly (it often arrives wrapped in a tensorstore message)."""
    text = f"{type(exc).__name__}: {exc}"
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return f"no space left on device ({text})"
        seen = seen.__cause__ or seen.__context__
    if "No space left" in text or "ENOSPC" in text:
        return f"no space left on device ({text})"
    return text.splitlines()[0] if text else type(exc).__name__
