"""Durable checkpoints of a state sharded over processes: each process writes only its own shards.

The layout is the disk tier's (``storage/disk.py``): ``step_N/state/`` in Orbax's PyTree layout (zarr v2 per
array, uncompressed, no OCDBT) and ``step_N/manifest.json`` with every file's size and CRC32C, written last.
What differs is who writes what: an array sharded over a slice's processes is stored in chunks of one
process's box each (``storage/shards.py``), and only the first slice of the group writes:

- each of its processes writes the chunks of its boxes (a box several processes hold, as a replicated array,
  by the lowest of them), fsyncs them and reports the files it wrote (:func:`write_part`);
- its first process also writes every ``.zarray`` and Orbax's metadata files;
- the controller writes the manifest (:func:`commit`) once every process's part of the step has arrived
  from the same generation of the group: a part written by an older generation is never committed.

The disk tier reads the result whole, verified; plain Orbax restores it onto any mesh (it is an ordinary
multi-chunk zarr array); :func:`read_local` reads one process's boxes, only the chunks they overlap, each
verified against the manifest before use.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import google_crc32c
import jax
import numpy as np

from runtime.core.errors import CheckpointInvalid
from storage import manifest as mf
from storage import orbax_layout
from storage.checked_read import LAYOUT, STATE_DIR
from storage.disk import write_manifest
from storage.manifest import FileEntry, LeafEntry, Manifest
from storage.shards import Box, local_box, per_leaf

__all__ = ["commit", "read_local", "write_part", "writes"]

PyTree = Any


def _box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b.stop - b.start for b in box)


def writes(template: PyTree, shardings: PyTree, slice_size: int) -> list[bool]:
    """For every leaf of ``template``: whether this process writes its box to a durable checkpoint (it is in
    the first slice, and no lower process there holds the same box)."""
    me = jax.process_index()
    out = []
    for leaf, sharding in zip(jax.tree.leaves(template), jax.tree.leaves(per_leaf(shardings, template)), strict=True):
        shape = np.shape(leaf)
        mine = local_box(shape, sharding)
        out.append(me < slice_size and all(local_box(shape, sharding, p) != mine for p in range(me)))
    return out


def write_part(
    step_dir: Path, boxes: PyTree, template: PyTree, shardings: PyTree, *, owned: list[bool], lead: bool
) -> list[FileEntry]:
    """Write this process's part of a step's checkpoint under ``step_dir``; every file is fsynced.

    ``boxes`` is this process's :func:`~storage.shards.local_copy` of the step, ``owned`` what
    :func:`writes` says. The ``lead`` (the first process) writes every array's ``.zarray`` and Orbax's metadata.
    Returns the files written, relative to ``step_dir``, for the manifest. Raises OSError as the OS does.
    """
    state_dir = step_dir / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    entries: list[FileEntry] = []
    written: list[Path] = []

    def write(path: Path, data: bytes | memoryview) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        written.append(path)
        crc = int(google_crc32c.value(bytes(data) if isinstance(data, memoryview) else data))
        entries.append(FileEntry(path=path.relative_to(step_dir).as_posix(), size=len(memoryview(data)), crc32c=crc))

    tree_metadata: dict[str, Any] = {}
    paths = jax.tree_util.tree_flatten_with_path(template)[0]
    shardings_list = jax.tree.leaves(per_leaf(shardings, template))
    for (path, leaf), sharding, mine, own in zip(paths, shardings_list, jax.tree.leaves(boxes), owned, strict=True):
        key = mf.key_of(path)
        directory = state_dir / orbax_layout.array_dirname(key)
        directory.mkdir(exist_ok=True)
        shape = np.shape(leaf)
        box = local_box(shape, sharding)
        chunks = _box_shape(box)
        if lead:
            write(directory / ".zarray", orbax_layout.zarray(shape, chunks, np.asarray(leaf).dtype))
            name, node = orbax_layout.array_entry(key)
            tree_metadata[name] = node
        if own:
            array = np.ascontiguousarray(mine)
            chunk = ".".join(str(b.start // c) for b, c in zip(box, chunks, strict=True)) or "0"
            write(directory / chunk, memoryview(array.reshape(-1).view(np.uint8).data))
        written.append(directory)
    if lead:
        for name, data in orbax_layout.metadata_files(template, tree_metadata, state_dir):
            write(state_dir / name, data)
    orbax_layout.fsync_all([*written, state_dir, step_dir])
    return entries


def commit(
    step_dir: Path,
    *,
    step: int,
    data_position: int,
    structure: str,
    leaves: tuple[LeafEntry, ...],
    files: list[FileEntry],
    metadata: dict[str, Any],
) -> Manifest:
    """Write ``step``'s manifest, listing every process's ``files``: the checkpoint exists from now on."""
    manifest = Manifest(
        step=step,
        data_position=data_position,
        layout=LAYOUT,
        structure=structure,
        leaves=leaves,
        files=tuple(sorted(files, key=lambda f: f.path)),
        metadata=metadata,
    )
    write_manifest(step_dir, manifest, sync=True)
    return manifest


def read_local(step_dir: Path, manifest: Manifest, template: PyTree, shardings: PyTree) -> tuple[PyTree, int]:
    """This process's boxes of the committed checkpoint in ``step_dir`` (as ``local_copy`` makes them), read
    from the chunk files that overlap them, each verified against the manifest; and the bytes read.

    Raises:
        CheckpointInvalid: a file is missing, truncated or damaged, or the array is not stored as expected.
    """
    entries = {entry.path: entry for entry in manifest.files}
    read = 0

    def checked(rel: str) -> bytes:
        """The file's bytes, once its size and CRC32C match the manifest's."""
        nonlocal read
        path, entry = step_dir / rel, entries.get(rel)
        try:
            data = path.read_bytes() if entry is not None else b""
        except OSError as exc:
            raise CheckpointInvalid(f"cannot read {path}: {exc}", path=str(path), reason=str(exc)) from exc
        if entry is None or len(data) != entry.size or int(google_crc32c.value(data)) != entry.crc32c:
            reason = "not in the manifest" if entry is None else "size or CRC32C differs from the manifest's"
            raise CheckpointInvalid(f"{path}: {reason}", path=str(path), reason=reason)
        read += len(data)
        return data

    out = []
    paths = jax.tree_util.tree_flatten_with_path(template)[0]
    for (path, leaf), sharding in zip(paths, jax.tree.leaves(per_leaf(shardings, template)), strict=True):
        name = f"{STATE_DIR}/{orbax_layout.array_dirname(mf.key_of(path))}"
        shape, dtype = np.shape(leaf), np.asarray(leaf).dtype
        chunks = tuple(json.loads(checked(f"{name}/.zarray"))["chunks"])
        box = local_box(shape, sharding)
        mine = np.empty(_box_shape(box), dtype)
        # Every chunk that overlaps the box: its grid index along each axis.
        ranges = [range(b.start // c, -(-b.stop // c)) for b, c in zip(box, chunks, strict=True)]
        for index in itertools.product(*ranges):
            chunk = np.frombuffer(checked(f"{name}/{'.'.join(map(str, index)) or '0'}"), dtype).reshape(chunks)
            lo = [i * c for i, c in zip(index, chunks, strict=True)]
            part = tuple(slice(max(b.start, o), min(b.stop, o + c)) for b, o, c in zip(box, lo, chunks, strict=True))
            mine[tuple(slice(p.start - b.start, p.stop - b.start) for p, b in zip(part, box, strict=True))] = chunk[
                tuple(slice(p.start - o, p.stop - o) for p, o in zip(part, lo, strict=True))
            ]
        out.append(mine)
    return jax.tree.unflatten(jax.tree.structure(template), out), read
