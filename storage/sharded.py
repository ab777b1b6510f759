"""Durable checkpoints of a state sharded over processes: each process writes only its own shards.

The layout is the disk tier's (``storage/disk.py``), in a folder or under ``gs://BUCKET/PREFIX`` as the GCS
tier's (:class:`ShardedStore`): ``step_N/state/`` in Orbax's PyTree layout (zarr v2 per array, uncompressed,
no OCDBT) and ``step_N/manifest.json`` with every file's size and CRC32C, written last.
What differs is who writes what: an array sharded over a slice's processes is stored in chunks of one
process's box each (``storage/boxes.py``), and only the first slice of the group writes:

- each of its processes writes the chunks of its boxes (a box several processes hold, as a replicated array,
  by the lowest of them), fsyncs them and reports the files it wrote (:func:`write_part`);
- its first process also writes every ``.zarray`` and Orbax's metadata files;
- the controller writes the manifest (:func:`manifest_of`) once every process's part of the step has arrived
  from the same generation of the group: a part written by an older generation is never committed.

The disk tier reads the result whole, verified; plain Orbax restores it onto any mesh (it is an ordinary
multi-chunk zarr array); :func:`read_local` reads one process's boxes, only the chunks they overlap, each
verified against the manifest before use.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable
from elastic_runtime.storage import manifest as mf
from elastic_runtime.storage import orbax_layout
from elastic_runtime.storage.boxes import Box, leaf_dtype, local_box, per_leaf
from elastic_runtime.storage.checked_read import LAYOUT, STATE_DIR
from elastic_runtime.storage.disk import DiskTier, write_manifest
from elastic_runtime.storage.manifest import FileEntry, LeafEntry, Manifest
from elastic_runtime.storage.pagecache import SyncedFiles

if TYPE_CHECKING:
    from elastic_runtime.storage.gcs import GcsTier

__all__ = ["ShardedStore", "manifest_of", "read_local", "write_part", "writes"]

PyTree = Any
_TIMEOUT_S = 600.0  # one request-bound operation on the store
# Chunk files a process reads at once when it restores its shards (a GCS read is a request of its own; the
# client's connection pool holds 10).
READS_AT_ONCE = 8


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
    step_dir: Path,
    boxes: PyTree,
    template: PyTree,
    shardings: PyTree,
    *,
    owned: list[bool],
    lead: bool,
    process: int | None = None,
) -> list[FileEntry]:
    """Write this process's part of a step's checkpoint under ``step_dir``; every file is fsynced.

    ``boxes`` is this process's :func:`~elastic_runtime.storage.boxes.local_copy` of the step, ``owned`` what
    :func:`writes` says. The ``lead`` (the first process) writes every array's ``.zarray`` and Orbax's metadata.
    ``process``: this process's index in the group that made ``shardings`` (default: ``jax.process_index()``);
    a write in a background thread passes it, since asking JAX while the group re-forms would bring up a
    backend outside the group. Returns the files written, relative to ``step_dir``, for the manifest. Raises
    OSError as the OS does.
    """
    state_dir = step_dir / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    entries: list[FileEntry] = []
    files = SyncedFiles(sync=True)
    directories: list[Path] = []

    def write(path: Path, data: bytes | memoryview, crc: int) -> None:
        size = files.write_file(path, data, replace=True)
        entries.append(FileEntry(path=path.relative_to(step_dir).as_posix(), size=size, crc32c=crc))

    def write_bytes(path: Path, data: bytes) -> None:
        write(path, data, mf.crc32c(data))

    tree_metadata: dict[str, Any] = {}
    paths = jax.tree_util.tree_flatten_with_path(template)[0]
    shardings_list = jax.tree.leaves(per_leaf(shardings, template))
    for (path, leaf), sharding, mine, own in zip(paths, shardings_list, jax.tree.leaves(boxes), owned, strict=True):
        key = mf.key_of(path)
        directory = state_dir / orbax_layout.array_dirname(key)
        directory.mkdir(exist_ok=True)
        shape = np.shape(leaf)
        box = local_box(shape, sharding, process)
        chunks = _box_shape(box)
        if lead:
            write_bytes(directory / ".zarray", orbax_layout.zarray(shape, chunks, leaf_dtype(leaf)))
            name, node = orbax_layout.array_entry(key)
            tree_metadata[name] = node
        if own:
            array = np.ascontiguousarray(mine)
            chunk = ".".join(str(b.start // c) for b, c in zip(box, chunks, strict=True)) or "0"
            # The chunk's CRC32C from the array in memory, without a copy of its bytes.
            write(directory / chunk, array.reshape(-1).view(np.uint8).data, mf.crc32c(array))
        directories.append(directory)
    if lead:
        for name, data in orbax_layout.metadata_files(template, tree_metadata, state_dir):
            write_bytes(state_dir / name, data)
    files.finish([*directories, state_dir, step_dir])
    return entries


def manifest_of(
    *,
    step: int,
    data_position: int,
    structure: str,
    leaves: tuple[LeafEntry, ...],
    files: list[FileEntry],
    metadata: dict[str, Any],
) -> Manifest:
    """The manifest of ``step``, listing every process's ``files``; writing it commits the step."""
    return Manifest(
        step=step,
        data_position=data_position,
        layout=LAYOUT,
        structure=structure,
        leaves=leaves,
        files=tuple(sorted(files, key=lambda f: f.path)),
        metadata=metadata,
    )


def read_local(
    manifest: Manifest,
    template: PyTree,
    shardings: PyTree,
    read: Callable[[str], bytes],
    where: str,
    *,
    process: int | None = None,
    concurrency: int = READS_AT_ONCE,
) -> tuple[PyTree, int]:
    """This process's boxes of the committed checkpoint ``manifest`` describes (as ``local_copy`` makes them),
    from the chunk files that overlap them (``read(rel)`` gives a file's bytes), each checked against the
    manifest before use; and the bytes read. Up to ``concurrency`` files are read at once (a GCS read is a
    request: one at a time, its latency and not the link bounds the restore), at most twice that many held.
    ``where`` names the checkpoint in errors; ``process`` is as :func:`write_part`'s.

    Raises:
        CheckpointInvalid: a file is missing, truncated or damaged, or the array is not stored as expected.
    """
    entries = {entry.path: entry for entry in manifest.files}

    def checked(rel: str) -> bytes:
        """The file's bytes, once its size and CRC32C match the manifest's."""
        path, entry = f"{where}/{rel}", entries.get(rel)
        if entry is None:
            raise CheckpointInvalid(f"{path}: not in the manifest", path=path, reason="not in the manifest")
        try:
            data = read(rel)
        except OSError as exc:
            raise CheckpointInvalid(f"cannot read {path}: {exc}", path=path, reason=str(exc)) from exc
        mf.check_entry(path, entry, len(data), mf.crc32c(data))
        return data

    paths = jax.tree_util.tree_flatten_with_path(template)[0]
    leaves = list(zip(paths, jax.tree.leaves(per_leaf(shardings, template)), strict=True))
    names = [f"{STATE_DIR}/{orbax_layout.array_dirname(mf.key_of(path))}" for (path, _), _ in leaves]
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="read-shards") as pool:
        headers = list(pool.map(lambda name: checked(f"{name}/.zarray"), names))
        nbytes = sum(len(header) for header in headers)
        out, pieces = [], []  # each leaf's box, and every chunk file that overlaps one: (leaf, grid index)
        for i, (((_, leaf), sharding), header) in enumerate(zip(leaves, headers, strict=True)):
            chunks = tuple(json.loads(header)["chunks"])
            box = local_box(np.shape(leaf), sharding, process)
            out.append((np.empty(_box_shape(box), leaf_dtype(leaf)), box, chunks))
            ranges = [range(b.start // c, -(-b.stop // c)) for b, c in zip(box, chunks, strict=True)]
            pieces += [(i, index) for index in itertools.product(*ranges)]
        files = [f"{names[i]}/{'.'.join(map(str, index)) or '0'}" for i, index in pieces]
        for (i, index), data in zip(pieces, _in_order(pool, checked, files, 2 * concurrency), strict=True):
            nbytes += len(data)
            mine, box, chunks = out[i]
            chunk = np.frombuffer(data, mine.dtype).reshape(chunks)
            lo = [k * c for k, c in zip(index, chunks, strict=True)]
            part = tuple(slice(max(b.start, o), min(b.stop, o + c)) for b, o, c in zip(box, lo, chunks, strict=True))
            mine[tuple(slice(p.start - b.start, p.stop - b.start) for p, b in zip(part, box, strict=True))] = chunk[
                tuple(slice(p.start - o, p.stop - o) for p, o in zip(part, lo, strict=True))
            ]
    return jax.tree.unflatten(jax.tree.structure(template), [mine for mine, _, _ in out]), nbytes


def _in_order(
    pool: ThreadPoolExecutor, fetch: Callable[[str], bytes], names: list[str], window: int
) -> Iterator[bytes]:
    """``fetch(name)`` of every name, in order, at most ``window`` of them submitted and not yet taken."""
    pending: deque[Future[bytes]] = deque()
    for name in names:
        pending.append(pool.submit(fetch, name))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


class ShardedStore:
    """Where a group's durable checkpoints live: a folder every host reaches (a persistent disk, NFS) or
    ``gs://BUCKET/PREFIX``. In GCS each writer's files go through a local staging folder and are uploaded,
    each checked against its CRC32C; the manifest object is the commit, as for the GCS tier.

    Args:
        location: the folder, or the ``gs://`` URI.
        staging: where GCS writes stage (default: the system's temporary folder).
    """

    def __init__(self, location: str, *, staging: str | None = None) -> None:
        self.location = location.rstrip("/")
        self.gcs: GcsTier | None = None
        if location.startswith("gs://"):
            from elastic_runtime.storage.gcs import GcsTier  # google-cloud-storage only where a run uses GCS

            self.gcs = GcsTier(location, name="durable", workers=2)  # few transfers: a slice's processes upload at once
        self.disk = DiskTier(location, name="durable", check_space=False) if self.gcs is None else None
        self.staging = staging

    @property
    def tier(self) -> str:
        """The tier's name in restore sources: ``gcs`` or ``disk``."""
        return "gcs" if self.gcs is not None else "disk"

    def where(self, step: int) -> str:
        return f"{self.location}/{mf.step_dirname(step)}"

    def steps(self) -> list[int]:
        """Committed steps, newest first."""
        store = self.gcs or self.disk
        assert store is not None
        return store.steps(timeout=_TIMEOUT_S)

    def manifest(self, step: int) -> Manifest:
        """Raises SnapshotUnavailable (not committed) or CheckpointInvalid."""
        if self.gcs is not None:
            return self.gcs.manifest(step, timeout=_TIMEOUT_S)
        assert self.disk is not None
        return self.disk.manifest(step)

    def write(self, step: int, boxes: PyTree, template: PyTree, shardings: PyTree, **part: Any) -> list[FileEntry]:
        """Write this process's part of ``step`` (:func:`write_part`; ``part``: its ``owned``, ``lead`` and
        ``process``)."""
        if self.disk is not None:
            return write_part(self.disk.path_of(step), boxes, template, shardings, **part)
        assert self.gcs is not None
        with tempfile.TemporaryDirectory(prefix="durable-part-", dir=self.staging) as staging:
            entries = write_part(Path(staging), boxes, template, shardings, **part)
            self.gcs.upload_files(step, staging, entries, timeout=_TIMEOUT_S)
        return entries

    def commit(self, manifest: Manifest) -> None:
        """Write ``manifest``: its step exists from now on."""
        if self.disk is not None:
            write_manifest(self.disk.path_of(manifest.step), manifest, sync=True)
        else:
            assert self.gcs is not None
            self.gcs.put_manifest(manifest, timeout=_TIMEOUT_S)

    def read(
        self, step: int, manifest: Manifest, template: PyTree, shardings: PyTree, *, process: int | None = None
    ) -> tuple[PyTree, int]:
        """This process's boxes of committed ``step`` (:func:`read_local`), and the bytes read."""
        if self.disk is not None:
            directory = self.disk.path_of(step)
            return read_local(
                manifest,
                template,
                shardings,
                lambda rel: (directory / rel).read_bytes(),
                str(directory),
                process=process,
            )
        gcs = self.gcs
        assert gcs is not None
        return read_local(
            manifest,
            template,
            shardings,
            lambda rel: gcs.read_file(step, rel, timeout=_TIMEOUT_S),
            self.where(step),
            process=process,
        )

    def withdraw(self, step: int) -> None:
        """Make committed ``step`` invisible (a damaged one): its manifest is set aside, its files kept."""
        if self.disk is not None:
            manifest = self.disk.path_of(step) / mf.MANIFEST_NAME
            with contextlib.suppress(FileNotFoundError):  # withdrawn already (two members found it)
                manifest.rename(manifest.with_name(mf.MANIFEST_NAME + ".unreadable"))
            return
        assert self.gcs is not None
        self.gcs.withdraw(step, timeout=_TIMEOUT_S)

    def prune(self, keep: int, run_id: str) -> None:
        """Delete all but the ``keep`` newest committed steps of run ``run_id`` (another run's are not ours)."""
        store = self.gcs or self.disk
        assert store is not None
        ours = [step for step in store.steps(timeout=_TIMEOUT_S) if self._run_of(step) == run_id]
        for step in ours[keep:]:
            store.delete(step, timeout=_TIMEOUT_S)

    def _run_of(self, step: int) -> str | None:
        try:
            return str(self.manifest(step).metadata.get("run_id"))
        except (CheckpointInvalid, SnapshotUnavailable):
            return None  # not judged ours: left alone
