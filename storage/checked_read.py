"""Reading a committed checkpoint directory back, every byte checked against its manifest.

Each array's chunk files are read straight into the destination buffer and their CRC32C checked in the same
pass (one read of the data, no second copy); any file that fails is reported by name and nothing of that
checkpoint is returned. Uncompressed zarr2 (what :mod:`elastic_runtime.storage.orbax_layout` writes) is simple enough to
read directly; anything else falls back to Orbax's own reader after every file has been verified. The disk tier
reads its checkpoints with it, the GCS tier what it downloaded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from elastic_runtime.core.errors import CheckpointInvalid, StorageError
from elastic_runtime.storage import manifest as mf
from elastic_runtime.storage import orbax_layout, packed
from elastic_runtime.storage.manifest import FileEntry, KeyPart, Manifest
from elastic_runtime.storage.tier import PyTree, rebuild_tree

__all__ = ["LAYOUT", "STATE_DIR", "Deadline", "load_directory", "verify_directory", "verify_file"]

LAYOUT = "orbax-pytree"
STATE_DIR = "state"


class Deadline:
    """A point in time a tier call must finish by; checked between files (disk I/O cannot be interrupted)."""

    def __init__(self, timeout: float | None, what: str) -> None:
        self.end = None if timeout is None else time.monotonic() + timeout
        self.what = what
        self.timeout = timeout

    def check(self) -> None:
        if self.end is not None and time.monotonic() > self.end:
            raise StorageError(f"{self.what}: timed out after {self.timeout} s")


class _ZArray(msgspec.Struct, frozen=True):
    """The fields of a zarr v2 ``.zarray`` that the direct reader relies on."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    compressor: Any = None
    filters: Any = None
    order: str = "C"
    dimension_separator: str = "."
    zarr_format: int = 2


_zarray = msgspec.json.Decoder(_ZArray)


_zarray = msgspec.json.Decoder(_ZArray)


def _inside(root: Path, entry: FileEntry) -> Path:
    """``root / entry.path``, refusing one that resolves outside ``root`` (a planted symlink).

    Raises:
        CheckpointInvalid: the file, or a directory on its way, links out of the checkpoint.
    """
    path = root / entry.path
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        reason = f"{entry.path} resolves outside the checkpoint"
        raise CheckpointInvalid(f"{path}: {reason}", path=str(path), reason=reason)
    return path


def verify_file(root: Path, entry: FileEntry) -> None:
    """Raises CheckpointInvalid when the file under ``root`` is missing, of another size or another CRC32C."""
    path = _inside(root, entry)
    try:
        size, crc = mf.crc32c_file(path)
    except FileNotFoundError as exc:
        raise CheckpointInvalid(f"{path} is missing", path=str(path), reason="missing") from exc
    except OSError as exc:
        raise CheckpointInvalid(f"cannot read {path}: {exc}", path=str(path), reason=str(exc)) from exc
    mf.check_entry(path, entry, size, crc)


def verify_directory(directory: Path, manifest: Manifest, deadline: Deadline | None = None) -> None:
    """Check every file a manifest lists. Raises CheckpointInvalid naming the first bad file."""
    for entry in manifest.files:
        if deadline is not None:
            deadline.check()
        verify_file(directory, entry)


def load_directory(directory: Path, manifest: Manifest, like: PyTree, deadline: Deadline) -> PyTree:
    """Load a committed checkpoint directory, verifying every file on the way. Raises CheckpointInvalid."""
    if manifest.layout == packed.LAYOUT:
        return rebuild_tree(manifest, packed.read_arrays(directory, manifest), like)
    if manifest.layout != LAYOUT:
        reason = f"layout {manifest.layout!r} is not {LAYOUT!r}"
        raise CheckpointInvalid(f"{directory}: {reason}", path=str(directory), reason=reason)
    entries = {entry.path: entry for entry in manifest.files}
    verified: set[str] = set()
    arrays: dict[tuple[KeyPart, ...], np.ndarray] = {}
    direct = True
    for leaf in manifest.leaves:
        deadline.check()
        try:
            dtype = mf.dtype_of(leaf.dtype)
        except ValueError as exc:
            raise CheckpointInvalid(f"{directory}: {exc}", path=str(directory), reason=str(exc)) from exc
        array = _read_zarr2(
            directory, f"{STATE_DIR}/{orbax_layout.array_dirname(leaf.key)}", leaf.shape, dtype, entries, verified
        )
        if array is None:
            direct = False
            break
        arrays[leaf.key] = array
    for path, entry in entries.items():
        if path not in verified:
            deadline.check()
            verify_file(directory, entry)
    if not direct:
        arrays = _read_with_orbax(directory / STATE_DIR, manifest)
    return rebuild_tree(manifest, arrays, like)


def _read_zarr2(
    root: Path,
    array_dir: str,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    entries: dict[str, FileEntry],
    verified: set[str],
) -> np.ndarray | None:
    """Read one uncompressed zarr2 array, checking each chunk file's CRC32C as it is read.

    Returns None (use Orbax's reader) for anything but plain C-order uncompressed chunks that are all present.
    """
    meta_path = f"{array_dir}/.zarray"
    meta_entry = entries.get(meta_path)
    if meta_entry is None:
        return None
    raw = _read_verified(root, meta_entry)
    verified.add(meta_path)
    try:
        meta = _zarray.decode(raw)
    except msgspec.MsgspecError:
        return None
    if meta.compressor is not None or meta.filters or meta.order != "C" or meta.zarr_format != 2:
        return None
    if tuple(meta.shape) != shape or len(meta.chunks) != len(shape) or np.dtype(_zarr_dtype(meta.dtype)) != dtype:
        return None
    out = np.empty(shape, dtype)
    chunks = tuple(meta.chunks)
    grid = [-(-s // c) if c else 1 for s, c in zip(shape, chunks, strict=True)]
    sep = meta.dimension_separator
    for index in np.ndindex(*grid) if grid else [()]:
        name = sep.join(str(i) for i in index) if index else "0"
        rel = f"{array_dir}/{name}"
        entry = entries.get(rel)
        if entry is None:
            return None  # a chunk left out as fill value: let Orbax decide what it means
        if chunks == shape and out.flags.c_contiguous:
            _read_into(root, entry, _bytes_of(out))
        else:
            buffer = np.empty(chunks, dtype)
            _read_into(root, entry, _bytes_of(buffer))
            region = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunks, shape, strict=True))
            out[region] = buffer[tuple(slice(0, r.stop - r.start) for r in region)]
        verified.add(rel)
    return out


def _bytes_of(array: np.ndarray) -> memoryview:
    # A uint8 view: the buffer protocol cannot export JAX's extra dtypes (bfloat16) directly.
    return memoryview(array.reshape(-1).view(np.uint8).data)


def _zarr_dtype(name: str) -> np.dtype[Any]:
    try:
        return np.dtype(name)
    except TypeError:
        return mf.dtype_of(name)  # bfloat16 and friends are spelled by name


def _read_verified(root: Path, entry: FileEntry) -> bytes:
    path = _inside(root, entry)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointInvalid(f"cannot read {path}: {exc}", path=str(path), reason=str(exc)) from exc
    mf.check_entry(path, entry, len(data), mf.crc32c(data))
    return data


def _read_into(root: Path, entry: FileEntry, target: memoryview) -> None:
    """Fill ``target`` from the file, CRC32C-checking what was read; a short or long file is invalid."""
    path = _inside(root, entry)
    crc = total = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while total < len(target):
                n = f.readinto(target[total : total + (64 << 20)])
                if not n:
                    break
                crc = mf.crc32c(target[total : total + n], crc)
                total += n
            extra = f.read(1)
    except FileNotFoundError as exc:
        raise CheckpointInvalid(f"{path} is missing", path=str(path), reason="missing") from exc
    except OSError as exc:
        raise CheckpointInvalid(f"cannot read {path}: {exc}", path=str(path), reason=str(exc)) from exc
    if extra or total != len(target):
        size = total + len(extra)
        reason = f"size {size}{'+' if extra else ''}, expected {len(target)} (manifest says {entry.size})"
        raise CheckpointInvalid(f"{path}: {reason} (truncated or overwritten)", path=str(path), reason=reason)
    mf.check_entry(path, entry, total, crc)


def _read_with_orbax(state_dir: Path, manifest: Manifest) -> dict[tuple[KeyPart, ...], np.ndarray]:
    import jax
    import orbax.checkpoint as ocp

    template = rebuild_tree(
        manifest, {leaf.key: np.zeros(leaf.shape, mf.dtype_of(leaf.dtype)) for leaf in manifest.leaves}, None
    )
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), template)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        tree = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(item=template, restore_args=restore_args))
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {mf.key_of(path): np.asarray(leaf) for path, leaf in with_path}
