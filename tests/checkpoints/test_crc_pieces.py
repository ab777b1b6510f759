"""Checksums in pieces: google_crc32c holds the GIL for the whole of each call, so storage never gives one call more
than ``CRC_PIECE`` bytes, and a worker's heartbeat thread runs while its replica files are written and read
(tests/benchmarks/bench_heartbeat_gap.py measures the gaps)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest

import elastic_runtime.storage
from elastic_runtime.storage import manifest as mf
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.replicas import ReplicaFiles, replica


class Recorder:
    """google_crc32c as elastic_runtime.storage.manifest uses it, noting how many bytes each call was given."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def extend(self, crc: int, data: Any) -> int:
        self.sizes.append(memoryview(data).nbytes)
        return int(google_crc32c.extend(crc, data))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(mf, "google_crc32c", recorder)
    return recorder


def big_state() -> dict[str, np.ndarray]:
    """A leaf of 2.5 pieces and a small one; the big one's bytes all differ from piece to piece."""
    rng = np.random.default_rng(0)
    return {"big": rng.random(5 * mf.CRC_PIECE // 8, np.float32), "small": np.arange(7, dtype=np.int32)}


def test_a_checksum_in_pieces_equals_the_checksum_in_one_call(calls: Recorder) -> None:
    data = big_state()["big"]
    whole = int(google_crc32c.value(data.tobytes()))
    assert mf.crc32c(data) == whole
    assert mf.crc32c(bytearray(data.tobytes())) == whole
    assert mf.crc32c(memoryview(data.tobytes())) == whole
    head = 3 * mf.CRC_PIECE // 2
    assert mf.crc32c(data.view(np.uint8)[head:], mf.crc32c(data.view(np.uint8)[:head])) == whole
    assert max(calls.sizes) == mf.CRC_PIECE


@pytest.mark.parametrize("packed", [False, True], ids=["orbax-layout", "packed"])
def test_writing_and_reading_a_checkpoint_checksums_in_pieces(tmp_path: Path, calls: Recorder, packed: bool) -> None:
    tier = DiskTier(tmp_path, name="shm", check_space=False, packed=packed, sync=False)
    state = big_state()
    tier.save(replica(1, 5, state), timeout=60)
    written = list(calls.sizes)
    calls.sizes.clear()
    restored = tier.restore(1, state, timeout=60)
    read = list(calls.sizes)
    np.testing.assert_array_equal(restored.tree["big"], state["big"])
    for sizes in (written, read):
        assert sum(sizes) >= state["big"].nbytes, sizes  # every byte was checksummed: the calls were seen
        assert max(sizes) <= mf.CRC_PIECE, sizes


def test_a_replica_file_is_written_and_read_with_checksums_in_pieces(tmp_path: Path, calls: Recorder) -> None:
    files = ReplicaFiles(tmp_path, "worker-0")
    state = big_state()
    try:
        files.save(replica(3, 7, state))
        files.wait()
        read = files.read(3, files.listed()[3], state)
    finally:
        files.close()
    np.testing.assert_array_equal(read.tree["big"], state["big"])
    assert sum(calls.sizes) >= 2 * state["big"].nbytes and max(calls.sizes) <= mf.CRC_PIECE, calls.sizes


def test_storage_checksums_only_through_the_pieces() -> None:
    """No other storage module calls google_crc32c itself (where one call could be given a whole array)."""
    modules = [
        importlib.import_module(f"elastic_runtime.storage.{m.name}")
        for m in pkgutil.iter_modules(elastic_runtime.storage.__path__)
    ]
    assert [m.__name__ for m in modules if hasattr(m, "google_crc32c")] == ["elastic_runtime.storage.manifest"]
