"""The worker's waits on its step thread and on the controller (``worker/stepping.py``), woken by what they wait
for: the step's end, a message, a lease. Each wait here would block for ever if its wake were lost."""

from __future__ import annotations

import math
import queue
import threading
import time
import types
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

from elastic_runtime.cluster.protocol import Form, Stop
from elastic_runtime.cluster.worker.stepping import await_step, wait_fenced
from elastic_runtime.cluster.worker.thread import StepThread

if TYPE_CHECKING:
    from elastic_runtime.cluster.worker.state import WorkerState


class Link:
    """The parts of ``ControllerLink`` the waits use, fed as its reader thread feeds them."""

    def __init__(self, lease_until: float = math.inf) -> None:
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.arrived = threading.Event()
        self.lease_until = lease_until

    def leased(self) -> bool:
        return time.monotonic() < self.lease_until

    def deliver(self, message: Any) -> None:
        self.inbox.put(message)
        self.arrived.set()

    def renew(self, seconds: float) -> None:
        self.lease_until = time.monotonic() + seconds
        self.arrived.set()


def a_worker(link: Link) -> WorkerState:
    worker = types.SimpleNamespace(
        link=link, step=5, worker=0, file_after_s=0.0, deferred=None, abandoned=[], step_pool=StepThread()
    )
    return cast("WorkerState", worker)


def later(seconds: float, fn: Any, *args: Any) -> None:
    threading.Timer(seconds, fn, args).start()


def test_the_step_ending_wakes_the_wait() -> None:
    worker = a_worker(Link())
    future: Future[tuple[Any, float]] = Future()
    later(0.2, future.set_result, ("new state", 0.1))
    assert await_step(worker, future) == ("new state", 0.1)


def test_a_message_behind_a_planned_form_is_answered_while_the_step_hangs() -> None:
    link = Link()
    worker = a_worker(link)
    planned = Form(generation=2, coordinator="127.0.0.1:1", process_id=0, num_processes=2, at_step=9)
    stop = Stop(reason="the run is over")
    link.deliver(planned)
    link.deliver(stop)  # both in before the wait looks: one wake for two messages
    hung: Future[tuple[Any, float]] = Future()  # a step blocked in a dead peer's collective: never ends
    assert await_step(worker, hung) == stop
    assert worker.deferred == planned  # kept for its step boundary
    assert worker.abandoned == [hung]


def test_a_message_that_comes_later_wakes_the_wait() -> None:
    link = Link()
    worker = a_worker(link)
    form = Form(generation=3, coordinator="127.0.0.1:1", process_id=0, num_processes=2)
    later(0.2, link.deliver, form)
    assert await_step(worker, Future()) == form


def test_a_fenced_worker_goes_on_when_its_lease_is_renewed_and_stops_at_a_message() -> None:
    link = Link(lease_until=time.monotonic() - 1.0)
    worker = a_worker(link)
    later(0.2, link.renew, 60.0)
    assert wait_fenced(worker) is None
    link.lease_until = time.monotonic() - 1.0
    stop = Stop(reason="judged lost")
    later(0.2, link.deliver, stop)
    assert wait_fenced(worker) == stop
