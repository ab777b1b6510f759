"""The next batches, loaded in a thread of its own while the current step is dispatched and computes."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from elastic_runtime.core.job import DataSource

__all__ = ["PREFETCH_DEPTH", "BatchPrefetcher"]

# Batches loaded ahead. One ahead left the step waiting whenever the loader thread was descheduled for more
# than a step (on a loaded 2-core machine 90 waits over 5 ms in 8000 steps, 1.1% of the run); three absorb
# such a pause, and hold three batches in host memory.
PREFETCH_DEPTH = 3


class BatchPrefetcher:
    """Loads ``data.batch`` up to ``depth`` positions ahead, in order, one call at a time."""

    def __init__(self, data: DataSource, depth: int = PREFETCH_DEPTH) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.data = data
        self.depth = depth
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-prefetch")
        self._ahead: dict[int, Future[Any]] = {}  # position -> its load, queued in order

    def batch(self, position: int) -> Any:
        """The batch at ``position``: the prefetched one if it was queued, else loaded now."""
        loading = self._ahead.pop(position, None)
        if loading is not None:
            return loading.result()  # a loading error surfaces here, in the step that needs it
        self._drop(lambda _: True)  # after a restore the position moved: one call at a time
        return self.data.batch(position)

    def prefetch(self, position: int) -> None:
        """Start loading the batches from ``position`` on, ``depth`` of them (those not queued already)."""
        self._drop(lambda queued: queued < position)
        for ahead in range(position, position + self.depth):
            if ahead not in self._ahead:
                self._ahead[ahead] = self._loader.submit(self.data.batch, ahead)

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)

    def _drop(self, stale: Callable[[int], bool]) -> None:
        """Forget the queued loads whose position ``stale`` says; wait for one already running."""
        for queued in [p for p in self._ahead if stale(p)]:
            loading = self._ahead.pop(queued)
            if not loading.cancel():
                wait([loading])
