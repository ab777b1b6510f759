"""The batch prefetcher: loads ahead in order, one call at a time, and drops what a moved position left."""

from __future__ import annotations

import threading

import pytest

from elastic_runtime.core.prefetch import BatchPrefetcher


class Recording:
    """Batch ``i`` is ``i``; remembers the order of the calls and whether two ever overlapped."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.overlapped = False
        self._running = threading.Lock()

    def batch(self, position: int) -> int:
        if not self._running.acquire(blocking=False):
            self.overlapped = True
            self._running.acquire()
        try:
            self.calls.append(position)
            return position
        finally:
            self._running.release()


def test_batches_come_in_order_and_each_is_loaded_once() -> None:
    data = Recording()
    prefetcher = BatchPrefetcher(data, depth=3)
    got = []
    for position in range(10):
        got.append(prefetcher.batch(position))
        prefetcher.prefetch(position + 1)
    prefetcher.close()
    assert got == list(range(10))
    assert data.calls[:10] == list(range(10))
    assert len(data.calls) == len(set(data.calls)) <= 13  # at most ``depth`` loaded beyond the last batch
    assert not data.overlapped


def test_a_moved_position_drops_the_queued_loads() -> None:
    data = Recording()
    prefetcher = BatchPrefetcher(data, depth=3)
    prefetcher.prefetch(1)
    assert prefetcher.batch(1) == 1
    prefetcher.prefetch(2)
    assert prefetcher.batch(0) == 0  # a restore went back: loaded now, the queue forgotten
    prefetcher.prefetch(1)
    assert [prefetcher.batch(p) for p in (1, 2, 3)] == [1, 2, 3]
    prefetcher.close()
    assert not data.overlapped


def test_depth_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="depth"):
        BatchPrefetcher(Recording(), depth=0)
