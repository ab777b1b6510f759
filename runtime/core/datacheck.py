"""Fingerprints of the batches a run read, to catch a data source that gives other data on a replay.

After a restore the steps since the restored one run again and read their batches again: with a
deterministic source (``DataSource``) those are the same bytes. With ``check_data`` on, every batch's CRC32C
is kept by position, and a batch read again that differs is reported as ``DataMismatch``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import google_crc32c
import jax
import numpy as np

from elastic_runtime.core.events import DataMismatch

__all__ = ["DataCheck", "fingerprint"]


def fingerprint(batch: Any) -> int:
    """CRC32C of a batch's structure and the bytes of its arrays."""
    checksum = google_crc32c.Checksum(str(jax.tree.structure(batch)).encode())
    for leaf in jax.tree.leaves(batch):
        array = np.ascontiguousarray(leaf)
        checksum.update(f"{array.dtype}{array.shape}".encode())
        view = array.reshape(-1).view(np.uint8)
        view.flags.writeable = False  # google_crc32c reads a read-only numpy buffer without a copy
        checksum.update(view)
    return int.from_bytes(checksum.digest(), "big")


class DataCheck:
    """The fingerprint of every batch read, by position (the newest ``keep`` positions)."""

    def __init__(self, keep: int = 100_000) -> None:
        self.keep = keep
        self._seen: OrderedDict[int, int] = OrderedDict()

    def check(self, position: int, batch: Any, *, step: int) -> DataMismatch | None:
        """Record ``batch`` as read at ``position``; the event when it differs from an earlier read."""
        crc = fingerprint(batch)
        before = self._seen.get(position)
        self._seen[position] = crc
        self._seen.move_to_end(position)
        while len(self._seen) > self.keep:
            self._seen.popitem(last=False)
        if before is None or before == crc:
            return None
        return DataMismatch(
            step=step,
            source="executor",
            position=position,
            expected_crc32c=f"{before:08x}",
            got_crc32c=f"{crc:08x}",
            message=f"the batch at position {position} differs from the one read there before the restore",
        )
