"""The next batch, loaded in a thread of its own while the current step is dispatched and computes."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from runtime.core.job import DataSource

__all__ = ["BatchPrefetcher"]


class BatchPrefetcher:
    """Loads ``data.batch(position)`` one position ahead, one call at a time."""

    def __init__(self, data: DataSource) -> None:
        self.data = data
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-prefetch")
        self._next: tuple[int, Future[Any]] | None = None

    def batch(self, position: int) -> Any:
        """The batch at ``position``: the prefetched one if it is that position, else loaded now."""
        prefetched, self._next = self._next, None
        if prefetched is not None and prefetched[0] == position:
            return prefetched[1].result()  # a loading error surfaces here, in the step that needs it
        if prefetched is not None:  # after a restore the position moved: drop it, one call at a time
            wait([prefetched[1]])
        return self.data.batch(position)

    def prefetch(self, position: int) -> None:
        """Start loading the batch at ``position``."""
        self._next = (position, self._loader.submit(self.data.batch, position))

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
