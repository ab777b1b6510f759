"""The step thread: where a worker runs its steps, restores and boundary agreements, so that the main thread stays
free to hear the controller while one of them is blocked in a dead peer's collective (``stepping.py``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["StepThread"]


class StepThread:
    """One daemon thread that runs the calls submitted to it in order, each answering a ``Future``: the step
    thread. A daemon, so that a call left blocked in a dead peer's collective (abandoned) never holds up the
    process's exit the way an executor's thread, joined at exit, would."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None]
        self._calls = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="step", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """No more calls: the thread ends after the one it runs, if that ever returns."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
