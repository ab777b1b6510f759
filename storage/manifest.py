"""The commit protocol's manifest: what a checkpoint holds, and the proof that it is complete.

A checkpoint exists only once its manifest exists: every data file is written (and made durable) first, the
manifest last and atomically (a rename on disk, the final object on GCS). The manifest lists every file with
its size and CRC32C, so a reader can tell a complete checkpoint from a torn, truncated or bit-flipped one
before loading a byte of it. It is msgspec JSON: decoding it runs no code (no pickle anywhere), and a manifest
that names a path outside its checkpoint is rejected.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import google_crc32c
import msgspec
import numpy as np

from elastic_runtime.core.errors import CheckpointInvalid

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
# One step per directory (or GCS prefix): zero-padded so that names sort like steps.
_STEP_DIR = re.compile(r"^step_(\d{10})$")
_READ_CHUNK = 8 << 20
# The most bytes one google_crc32c call is given: it holds the GIL for the whole call (256 MB in one call kept
# every other thread out for 24 ms here; a replica write of a 1 GB leaf held it 85-92 ms, 22 ms in pieces), and
# a worker's heartbeat thread must run while its replica files are written and read
# (tests/benchmarks/bench_heartbeat_gap.py, docs/benchmarks.md).
CRC_PIECE = 4 << 20

KeyPart = str | int


class FileEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One data file of a checkpoint, relative to the checkpoint's root, with its size and CRC32C."""

    path: str
    size: int
    crc32c: int


class LeafEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One array of the state: its key path in the tree (dict keys and sequence indices), shape and dtype."""

    key: tuple[KeyPart, ...]
    shape: tuple[int, ...]
    dtype: str


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a reader needs to verify and rebuild one checkpoint.

    Attributes:
        step: the committed step the state belongs to.
        data_position: where the data source resumes, so no batch is skipped or seen twice.
        layout: how the arrays are stored (``orbax-pytree``: an Orbax PyTree checkpoint under ``state/``;
            ``raw``: one file of raw bytes per leaf).
        structure: the tree structure, as JAX prints it (for humans and for a structure check on restore).
        leaves: every array, in tree order.
        files: every data file, with size and CRC32C.
        metadata: the user's and the runtime's plain-data metadata (mesh shape, RNG seeds, ...).
    """

    step: int
    data_position: int
    layout: str
    structure: str
    leaves: tuple[LeafEntry, ...]
    files: tuple[FileEntry, ...]
    metadata: dict[str, Any] = {}
    created: float = msgspec.field(default_factory=time.time)
    format: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        """Bytes of all data files together."""
        return sum(f.size for f in self.files)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Manifest)


def step_dirname(step: int) -> str:
    """The directory (or GCS prefix component) of ``step``'s checkpoint."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    return f"step_{step:010d}"


def parse_step_dirname(name: str) -> int | None:
    """The step a checkpoint directory name stands for, or None when the name is not one."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def encode(manifest: Manifest) -> bytes:
    return _encoder.encode(manifest)


def decode(data: bytes, *, where: str) -> Manifest:
    """Parse and check a manifest read from ``where``.

    Raises:
        CheckpointInvalid: not valid manifest JSON, an unknown format version, or a file path that is absolute
            or leaves the checkpoint (``..``), which could make a reader load or overwrite a foreign file.
    """
    try:
        manifest = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise CheckpointInvalid(f"manifest {where} does not validate: {exc}", path=where, reason=str(exc)) from exc
    except msgspec.DecodeError as exc:
        raise CheckpointInvalid(f"manifest {where} is not valid JSON: {exc}", path=where, reason=str(exc)) from exc
    if manifest.format != FORMAT_VERSION:
        reason = f"format {manifest.format}, this reader knows {FORMAT_VERSION}"
        raise CheckpointInvalid(f"manifest {where}: {reason}", path=where, reason=reason)
    for entry in manifest.files:
        check_relative(entry.path, where=where)
    return manifest


def check_relative(path: str, *, where: str) -> str:
    """Accept ``path`` only if it names a file inside the checkpoint: relative, no ``..``, no backslash.

    Raises:
        CheckpointInvalid: the path could reach outside the checkpoint.
    """
    # Only canonical relative paths: every component a plain name (no "", ".", ".."), no backslash or NUL.
    parts = path.split("/")
    bad = "\\" in path or "\x00" in path or any(part in ("", ".", "..") for part in parts) or path == MANIFEST_NAME
    if bad:
        reason = f"file path {path!r} is outside the checkpoint"
        raise CheckpointInvalid(f"manifest {where}: {reason}", path=where, reason=reason)
    return path


# --- building and checking ----------------------------------------------------------------------------


def crc32c(data: bytes | bytearray | memoryview | np.ndarray, crc: int = 0) -> int:
    """``crc`` (the CRC32C of what came before) extended by the bytes of ``data``, in place: a C-contiguous array
    (any dtype) or a bytes-like object. Fed to the C implementation ``CRC_PIECE`` bytes per call, so that other
    threads run between the calls: every CRC32C of a checkpoint's data is computed here."""
    # A new view either way (no copy: callers pass C-contiguous arrays), made read-only: google_crc32c takes
    # read-only numpy buffers without a copy.
    view = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    view.flags.writeable = False
    for start in range(0, view.size, CRC_PIECE):
        crc = google_crc32c.extend(crc, view[start : start + CRC_PIECE])
    return int(crc)


def crc32c_file(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Size and CRC32C of a file, read in large chunks (the C implementation runs at memory speed)."""
    crc = size = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ_CHUNK):
            crc = crc32c(chunk, crc)
            size += len(chunk)
    return size, crc


def files_under(root: Path) -> list[str]:
    """Every regular file below ``root``, as POSIX paths relative to it."""
    found = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return found


def describe_leaves(tree: Any) -> tuple[str, tuple[LeafEntry, ...]]:
    """The structure string and per-leaf key path, shape and dtype of a tree of arrays."""
    import jax  # here, not above: the controller reads manifests and never imports JAX

    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = tuple(
        LeafEntry(key=key_of(path), shape=tuple(np.shape(leaf)), dtype=np.dtype(leaf.dtype).name)
        for path, leaf in with_path
    )
    return str(treedef), leaves


def key_of(path: Sequence[Any]) -> tuple[KeyPart, ...]:
    """A JAX key path as plain dict keys and sequence indices (what the manifest stores)."""
    import jax

    parts: list[KeyPart] = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(entry.idx)
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            parts.append(entry.name)
        else:
            parts.append(str(entry))
    return tuple(parts)


def dtype_of(name: str) -> np.dtype[Any]:
    """The numpy dtype a manifest names, including JAX's extra types (bfloat16, float8 ...)."""
    import jax

    try:
        return np.dtype(jax.numpy.dtype(name))
    except TypeError as exc:
        raise ValueError(f"unknown dtype {name!r}") from exc


def check_entry(path: str | Path, entry: FileEntry, size: int, crc: int) -> None:
    """Raises CheckpointInvalid when a file of ``size`` bytes and CRC32C ``crc``, read from ``path``, is not the
    one ``entry`` names: a size apart is a truncated or overwritten file, a CRC32C apart altered bytes."""
    if size != entry.size:
        reason = f"size {size}, manifest says {entry.size}"
        raise CheckpointInvalid(f"{path}: {reason} (truncated or overwritten)", path=str(path), reason=reason)
    if crc != entry.crc32c:
        reason = f"crc32c {crc:08x}, manifest says {entry.crc32c:08x}"
        raise CheckpointInvalid(f"{path}: {reason} (altered bytes)", path=str(path), reason=reason)
