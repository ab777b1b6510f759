"""A tier's lane of background saves: one at a time; a save due while the lane is busy waits and runs next.

At most one save waits: a newer due save replaces an older one still waiting (which is skipped), so a slow tier
holds at most one snapshot more and never piles up host memory, and its newest save is never more than one write
behind: the tier's cadence stretches to what it can write instead of dropping every save due during a long one.
An explicit request (``forced``) is never dropped: a due save does not replace it (a newer request does).
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
        on_wait: called with a due item's step and the step being saved when it has to wait for that save.
        doing: what a save is called in the skip message ("save", "upload", "copy").
    """

    def __init__(
        self,
        name: str,
        work: Callable[[T], None],
        *,
        step_of: Callable[[T], int],
        on_skip: Callable[[int, str], None],
        on_wait: Callable[[int, int], None] = lambda step, running: None,
        doing: str = "save",
    ) -> None:
        self.work = work
        self.step_of = step_of
        self.on_skip = on_skip
        self.on_wait = on_wait
        self.doing = doing
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._job: Future[None] | None = None
        self._waiting: T | None = None
        self._waiting_forced = False
        self.step = -1  # the step of the save running now, or of the last one

    def busy(self) -> bool:
        with self._lock:
            return self._job is not None and not self._job.done()

    def submit(self, item: T, *, forced: bool = False) -> bool:
        """Start saving ``item``, or, when busy, let it wait for the save in progress, replacing an older waiting
        item (a replaced due save is skipped). A due item does not replace a waiting request: it is skipped then.
        False when ``item`` is skipped."""
        step = self.step_of(item)
        with self._lock:
            if self._job is None or self._job.done():
                self.step = step
                self._job = self._pool.submit(self._loop, item)
                return True
            running, waiting = self.step, self._waiting
            if waiting is not None and self._waiting_forced and not forced:
                kept, replaced = False, None
            else:
                kept = True
                superseded = waiting is not None and not self._waiting_forced and self.step_of(waiting) != step
                replaced = waiting if superseded else None
                self._waiting, self._waiting_forced = item, forced
        if not kept:
            assert waiting is not None
            self.on_skip(step, f"a requested {self.doing} of step {self.step_of(waiting)} waits already")
            return False
        if not forced:
            self.on_wait(step, running)
        if replaced is not None:
            why = f"replaced by step {step} while the {self.doing} of step {running} ran"
            self.on_skip(self.step_of(replaced), why)
        return True

    def _loop(self, item: T) -> None:
        while True:
            self.work(item)
            with self._lock:
                waiting, self._waiting, self._waiting_forced = self._waiting, None, False
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
