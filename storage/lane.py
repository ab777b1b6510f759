"""A tier's lane of background saves: one at a time, a due save skipped while the lane is busy.

Skipping rather than queueing keeps a slow tier from piling up host memory; an explicit request is never
dropped: it waits for the save in progress and runs next (a newer request replaces one still waiting).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["Lane"]

T = TypeVar("T")


class Lane(Generic[T]):
    """Runs ``work(item)`` in one background thread, one item at a time.

    Args:
        name: the thread's name prefix.
        work: saves one item; its failures are its own to report.
        step_of: the step an item saves (for the skip message).
        on_skip: called with the skipped item's step and why.
        doing: what a save is called in the skip message ("save", "upload", "copy").
    """

    def __init__(
        self,
        name: str,
        work: Callable[[T], None],
        *,
        step_of: Callable[[T], int],
        on_skip: Callable[[int, str], None],
        doing: str = "save",
    ) -> None:
        self.work = work
        self.step_of = step_of
        self.on_skip = on_skip
        self.doing = doing
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._job: Future[None] | None = None
        self._waiting: T | None = None
        self.step = -1  # the step of the save running now, or of the last one

    def busy(self) -> bool:
        with self._lock:
            return self._job is not None and not self._job.done()

    def submit(self, item: T, *, forced: bool = False) -> bool:
        """Start saving ``item``, or, when busy, queue it (``forced``) or skip it. False when skipped."""
        with self._lock:
            if self._job is not None and not self._job.done():
                if forced:
                    self._waiting = item
                    return True
                reason = f"the {self.doing} of step {self.step} is still running"
            else:
                self.step = self.step_of(item)
                self._job = self._pool.submit(self._loop, item)
                return True
        self.on_skip(self.step_of(item), reason)
        return False

    def _loop(self, item: T) -> None:
        while True:
            self.work(item)
            with self._lock:
                waiting, self._waiting = self._waiting, None
                if waiting is None:
                    return
                item = waiting
                self.step = self.step_of(item)

    def wait(self, timeout: float | None = None) -> None:
        """Block until nothing runs or waits. Raises TimeoutError after ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                job = self._job
            if job is None or job.done():
                return
            left = None if end is None else max(end - time.monotonic(), 0.0)
            try:
                job.result(timeout=left)
            except TimeoutError:
                raise TimeoutError(f"the {self.doing} of step {self.step} is still running after {timeout} s") from None
            except Exception:  # ``work`` reports its own failures
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=True)
