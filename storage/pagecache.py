"""Checkpoint files written without piling up dirty pages.

A process's dirty pages are charged to its memory cgroup (a container's limit, a SLURM job's), and reclaim at
the limit waits on their writeback (cgroup v1): a worker that wrote an 800 MB replica file and synced it at the
end stalled for 50-270 s, past the heartbeat timeout. :class:`SyncedFiles` syncs what it wrote every
``FLUSH_BYTES``, so a checkpoint never holds more dirty pages than that, whatever its files' sizes, and starts
the writeback of every ``PIECE_BYTES`` and of each file as it is closed, so those syncs find most of it done.
Clean pages stay in the page cache (reclaimed cheaply; a restore on the same host reads them).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

PIECE_BYTES = 64 << 20  # written, then its writeback started
FLUSH_BYTES = 256 << 20  # written since the last sync: synced (waited for)


def _load_sync_file_range() -> Callable[[int], None]:
    """``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)``: start the writeback of a file's dirty pages without
    waiting for it, and without dropping them from the page cache (Linux; elsewhere a no-op: the syncs every
    ``FLUSH_BYTES`` still bound the dirty pages)."""
    function = getattr(ctypes.CDLL(None), "sync_file_range", None)  # the process's own symbols: libc's among them
    if function is None:
        return lambda fd: None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd: function(fd, 0, 0, 2)  # advisory: the syncs that follow report any write error


start_writeback = _load_sync_file_range()


def sync_all(paths: list[Path], *, workers: int = 16) -> None:
    """fsync files and directories concurrently.

    One after another, each fsync waits for its own journal commit (hundreds of arrays would cost seconds);
    issued together, the file system folds them into a few group commits.
    """

    def sync(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if not paths:
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(paths)), thread_name_prefix="fsync") as pool:
        for future in [pool.submit(sync, p) for p in paths]:
            future.result()


class SyncedFiles:
    """The files of one checkpoint. With ``sync``, once ``FLUSH_BYTES`` have been written since the last sync,
    every file written since is synced; :meth:`finish` syncs the rest and the directories named. Without
    ``sync`` (``/dev/shm``: a tmpfs), nothing is synced."""

    def __init__(self, *, sync: bool) -> None:
        self.sync = sync
        self._unsynced: list[Path] = []  # written since the last sync
        self._unsynced_bytes = 0
        self._unstarted_bytes = 0  # written since a writeback was last started

    @contextmanager
    def create(self, path: Path, *, replace: bool = False) -> Iterator[Callable[[bytes | memoryview], None]]:
        """Open ``path`` (new, or truncated with ``replace``); yields a function that appends bytes to it."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL), 0o644)
        try:
            yield lambda data: self._write(fd, data)
            if self.sync:
                start_writeback(fd)
        finally:
            os.close(fd)
        self._unsynced.append(path)

    def write_file(self, path: Path, data: bytes | memoryview, *, replace: bool = False) -> int:
        """Write ``data`` as the file ``path``; returns its size."""
        with self.create(path, replace=replace) as write:
            write(data)
        return memoryview(data).nbytes

    def finish(self, directories: list[Path]) -> None:
        """Sync what is left, and ``directories``: every file is durable once this returns."""
        if self.sync:
            sync_all([*self._unsynced, *directories])
        self._unsynced, self._unsynced_bytes = [], 0

    def _write(self, fd: int, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), PIECE_BYTES):
            piece = view[start : start + PIECE_BYTES]
            self._unsynced_bytes += len(piece)
            self._unstarted_bytes += len(piece)
            while piece:
                piece = piece[os.write(fd, piece) :]
            if not self.sync:
                continue
            if self._unstarted_bytes >= PIECE_BYTES:
                start_writeback(fd)
                self._unstarted_bytes = 0
            if self._unsynced_bytes >= FLUSH_BYTES:
                os.fdatasync(fd)
                sync_all(self._unsynced)
                self._unsynced, self._unsynced_bytes = [], 0
