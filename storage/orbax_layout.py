"""Writing Orbax's PyTree layout directly: the bytes Orbax itself writes, at the speed of the disk.

A host snapshot is a tree of numpy arrays, and the layout ``PyTreeCheckpointHandler(use_ocdbt=False,
use_compression=False)`` gives it is simple: per array a zarr v2 directory named by its key path joined with
dots, holding ``.zarray`` and one chunk file with the array's raw C-order bytes; ``_METADATA`` lists the tree;
``_CHECKPOINT_METADATA`` says which handler reads it. Writing those files ourselves costs one sequential write
per array and a concurrent round of fsyncs every 256 MiB (``elastic_runtime.storage.pagecache``; no event loop, no
temporary directory, no per-chunk locks), and the CRC32C of each file comes from the array in memory rather than from
reading the file back. Plain ``orbax.checkpoint`` restores the result (a test compares it with what the
installed Orbax writes). Trees this writer does not cover (exotic dtypes, empty arrays, keys with dots or
slashes) go through Orbax itself.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from elastic_runtime.compat import orbax as orbax_compat
from elastic_runtime.storage import manifest as mf
from elastic_runtime.storage.manifest import FileEntry, KeyPart, key_of
from elastic_runtime.storage.pagecache import SyncedFiles

PyTree = Any
# Dtypes whose zarr v2 spelling is numpy's own type string; JAX's extra types are spelled by name.
_PLAIN_KINDS = frozenset("biufc")
_NAMED = frozenset({"bfloat16"})


def zarr_dtype(dtype: np.dtype[Any]) -> str | None:
    """The zarr v2 ``dtype`` tensorstore writes for ``dtype``, or None when this writer does not cover it."""
    if dtype.kind in _PLAIN_KINDS:
        return dtype.str
    if dtype.name in _NAMED:
        return dtype.name
    return None


def covers(tree: PyTree) -> bool:
    """Whether :func:`write_tree` can write ``tree`` (else use Orbax's own writer)."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = set()
    for path, leaf in with_path:
        if not isinstance(leaf, np.ndarray) or leaf.size == 0 or zarr_dtype(leaf.dtype) is None:
            return False
        key = key_of(path)
        if not key or any(not isinstance(k, (str, int)) or "." in str(k) or "/" in str(k) for k in key):
            return False
        name = array_dirname(key)
        if name in names or name.startswith("_"):
            return False
        names.add(name)
    return bool(with_path)


def array_dirname(key: tuple[KeyPart, ...]) -> str:
    """Orbax names an array's directory by its key path joined with dots."""
    return ".".join(str(k) for k in key)


_COMMIT_NAME = "commit_success.txt"


def _tuple_key(key: tuple[KeyPart, ...]) -> str:
    """A key path as ``_METADATA`` spells it: the repr of a tuple of strings."""
    return "(" + ", ".join(repr(str(k)) for k in key) + ("," if len(key) == 1 else "") + ")"


def _entry(key: tuple[KeyPart, ...], value_type: str) -> dict[str, Any]:
    """One node of ``_METADATA``'s tree: an array (``np.ndarray``) or an empty node, which is not read back."""
    return {
        "key_metadata": [{"key": str(k), "key_type": 1 if isinstance(k, int) else 2} for k in key],
        "value_metadata": {"value_type": value_type, "skip_deserialize": value_type != "np.ndarray"},
    }


def _is_empty(node: Any) -> bool:
    return node is None or (isinstance(node, dict | list | tuple) and len(node) == 0)


def _empty_type(node: Any) -> str:
    """Orbax's name for an empty node; an empty NamedTuple (optax's ``EmptyState``) it records as None."""
    if isinstance(node, dict):
        return "Dict"
    if isinstance(node, list):
        return "List"
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return "Tuple"
    return "None"


def zarray(shape: tuple[int, ...], chunks: tuple[int, ...], dtype: np.dtype[Any]) -> bytes:
    """An array's ``.zarray``: zarr v2, uncompressed, C order, ``chunks`` per chunk file."""
    document = {
        "chunks": list(chunks),
        "compressor": None,
        "dimension_separator": ".",
        "dtype": zarr_dtype(dtype),
        "fill_value": None,
        "filters": None,
        "order": "C",
        "shape": list(shape),
        "zarr_format": 2,
    }
    return json.dumps(document, separators=(",", ":")).encode()


def array_entry(key: tuple[KeyPart, ...]) -> tuple[str, dict[str, Any]]:
    """An array's node in ``_METADATA``'s tree."""
    return _tuple_key(key), _entry(key, "np.ndarray")


def metadata_files(tree: PyTree, tree_metadata: dict[str, Any], state_dir: Path) -> list[tuple[str, bytes]]:
    """Orbax's files beside the arrays: ``_METADATA`` (``tree_metadata``, the arrays' nodes, plus ``tree``'s
    empty nodes), ``_CHECKPOINT_METADATA`` and the commit marker."""
    tree_metadata = dict(tree_metadata)
    # Empty nodes (None, {}, [], (), optax's EmptyState) hold no array, but Orbax records them: without them
    # a restore with the state as ``item`` finds another tree structure.
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty)[0]:
        if _is_empty(node):
            key = key_of(path)
            tree_metadata[_tuple_key(key)] = _entry(key, _empty_type(node))
    metadata = {
        "tree_metadata": tree_metadata,
        "use_ocdbt": False,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    now = time.time_ns()
    checkpoint_metadata = {
        "item_handlers": orbax_compat.pytree_handler_name(),
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": now,
        "commit_timestamp_nsecs": now,
        "custom_metadata": {},
    }
    documents = {"_METADATA": metadata, "_CHECKPOINT_METADATA": checkpoint_metadata}
    files = [(name, json.dumps(document).encode()) for name, document in documents.items()]
    files.append((_COMMIT_NAME, f"Checkpoint commit was successful to {state_dir}".encode()))  # as Orbax writes
    return files


def write_tree(state_dir: Path, tree: PyTree, *, root: Path, sync: bool = True) -> list[FileEntry]:
    """Write ``tree`` in Orbax's layout under ``state_dir``; every file is fsynced (with ``sync``).

    Returns the files written, as manifest entries relative to ``root``. Raises OSError as the OS does.
    """
    state_dir.mkdir()
    entries: list[FileEntry] = []
    files = SyncedFiles(sync=sync)
    directories: list[Path] = [state_dir.parent, state_dir]

    def add(path: Path, data: bytes | memoryview, crc: int) -> None:
        size = files.write_file(path, data)
        entries.append(FileEntry(path=path.relative_to(root).as_posix(), size=size, crc32c=crc))

    tree_metadata: dict[str, Any] = {}
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in with_path:
        key = key_of(path)
        array = leaf if leaf.flags.c_contiguous else np.copy(leaf, order="C")  # keeps 0-d arrays 0-d
        directory = state_dir / array_dirname(key)
        directory.mkdir()
        meta = zarray(array.shape, array.shape, array.dtype)
        add(directory / ".zarray", meta, mf.crc32c(meta))
        chunk = directory / (".".join("0" for _ in array.shape) or "0")
        crc = mf.crc32c(array)
        add(chunk, array.reshape(-1).view(np.uint8).data, crc)
        directories.append(directory)
        name, node = array_entry(key)
        tree_metadata[name] = node
    for name, data in metadata_files(tree, tree_metadata, state_dir):
        add(state_dir / name, data, mf.crc32c(data))
    files.finish(directories)  # every file and every directory entry is durable before the manifest is written
    return entries
