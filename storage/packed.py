"""The packed layout: every array of a snapshot in one file, for the ``/dev/shm`` mirror.

The mirror exists so that the newest snapshot survives a restart of the process on the same host; nothing but
this library reads it, so it need not be Orbax's layout. Orbax's layout costs two files and a directory per
array (350 files for a flax model of 116 arrays), and on a busy host that many small writes took 0.3-0.9 s
per snapshot (a median) where one sequential write of the same bytes takes milliseconds.

``ROOT/step_N/state.bin`` holds the arrays in the manifest's leaf order, each starting at a multiple of 64
bytes (zero padding between), so ``np.frombuffer`` reads each in place. The manifest lists the one file with
its size and CRC32C, computed from the arrays in memory as they are written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from elastic_runtime.core.errors import CheckpointInvalid
from elastic_runtime.storage import manifest as mf
from elastic_runtime.storage.manifest import FileEntry, KeyPart, Manifest
from elastic_runtime.storage.pagecache import SyncedFiles

LAYOUT = "packed"
FILE = "state.bin"
_ALIGN = 64
_ZEROS = bytes(_ALIGN)


def _padding(offset: int) -> int:
    return -offset % _ALIGN


def write_tree(directory: Path, tree: Any, *, sync: bool) -> list[FileEntry]:
    """Write the leaves of ``tree`` into ``directory/state.bin`` (fsynced if ``sync``, in pieces: see
    :mod:`elastic_runtime.storage.pagecache`); returns its manifest entry."""
    crc = 0
    size = 0
    files = SyncedFiles(sync=sync)
    with files.create(directory / FILE) as write:
        for leaf in jax.tree.leaves(tree):
            pad = _ZEROS[: _padding(size)]
            data = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
            write(pad)
            write(data.data)
            crc = mf.crc32c(data, mf.crc32c(pad, crc))
            size += len(pad) + data.size
    files.finish([])
    return [FileEntry(path=FILE, size=size, crc32c=int(crc))]


def read_arrays(directory: Path, manifest: Manifest) -> dict[tuple[KeyPart, ...], np.ndarray]:
    """The arrays of a packed checkpoint, by key, after checking the file's size and CRC32C.

    Raises:
        CheckpointInvalid: the file is missing, of another size, or its checksum differs.
    """
    entry = next((f for f in manifest.files if f.path == FILE), None)
    path = directory / FILE

    def invalid(reason: str) -> CheckpointInvalid:
        return CheckpointInvalid(f"{path}: {reason}", path=str(path), reason=reason)

    if entry is None:
        raise invalid(f"the manifest lists no {FILE}")
    try:
        with open(path, "rb", buffering=0) as f:
            # Read straight into the arrays' buffer (the read releases the GIL): ``bytearray(f.read())`` copied
            # every byte once more holding it (0.2 s for 256 MB), and a zero-filled bytearray would too.
            data = np.empty(os.fstat(f.fileno()).st_size, np.uint8)
            size = 0
            while size < data.size and (n := f.readinto(data.data[size:])):
                size += n
    except OSError as exc:
        raise invalid(f"cannot be read ({exc})") from exc
    # The reasons are the Orbax layout's (``check_entry``): a size apart, or a CRC32C apart.
    mf.check_entry(path, entry, size, mf.crc32c(data[:size]))
    arrays = {}
    offset = 0
    for leaf in manifest.leaves:
        offset += _padding(offset)
        dtype = mf.dtype_of(leaf.dtype)
        count = int(np.prod(leaf.shape, dtype=np.int64))
        arrays[leaf.key] = np.frombuffer(data, dtype, count, offset).reshape(leaf.shape)
        offset += count * dtype.itemsize
    if offset != data.size:
        raise invalid(f"holds {data.size} bytes, its leaves take {offset}")
    return arrays
