"""The step thread: a step (or restore, or gather) runs in a thread that a peer's death can leave blocked in a
collective for ever. Awaiting it, the worker keeps reading the controller's messages: a ``Form`` abandons the
thread, a planned one is kept for its step boundary, and with no lease the worker stops stepping until the
controller is heard again.
"""

from __future__ import annotations

import gc
import logging
import math
import queue
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from elastic_runtime.cluster.protocol import Form, Stop
from elastic_runtime.cluster.worker.link import Inbound
from elastic_runtime.cluster.worker.state import WorkerState
from elastic_runtime.cluster.worker.thread import StepThread
from elastic_runtime.core.classify import classify
from elastic_runtime.core.events import ProcessLost, StepFailed

__all__ = ["StepThread", "await_step", "defer", "defer_head", "wait_fenced"]

log = logging.getLogger(__name__)

# How long a step still running when the group re-forms may take to finish before it is abandoned. A Form that
# comes while a step runs follows a lost member, whose collectives then never return: the grace is spent whole in
# most recoveries (0.2 s was two fifths of a `kill -9`'s recovery at the demo's size), and a step it lets finish
# is one the group restores before anyway.
_ABANDON_GRACE_S = 0.05
# A drain's hold (``Stop(hold=True)``) follows no loss: a step every member entered finishes, and a member that
# abandoned it while a peer finished it held one step behind that peer, whose replica file of the step before may
# not exist (files come every few steps): the drain's final checkpoint then had no step every member could write
# (soak seed 6900107: 120 s waited for it). So a held step may take a few of its own durations to finish.
_HOLD_GRACE_STEPS, _HOLD_GRACE_MIN_S = 3.0, 1.0


def wait_fenced(worker: WorkerState) -> Inbound | None:
    """The lease ran out: no step and no replica write until the controller is heard again. Returns its
    next message (a Form, a Stop), or None when only the lease was renewed (a short blip)."""
    log.warning(
        "worker %d: no lease from the controller; stopped stepping and writing replicas at step %d",
        worker.worker,
        worker.step,
    )
    while True:
        worker.link.arrived.clear()  # before the look: what comes after it wakes the wait
        try:
            message = worker.link.inbox.get_nowait()
        except queue.Empty:
            if worker.link.leased():
                log.warning("worker %d: lease renewed; stepping again", worker.worker)
                return None
            worker.link.arrived.wait()  # a message, or a lease (the connection's end puts a Stop)
            continue
        if not defer(worker, message):  # a planned re-forming waits for its step, as in training.train
            return message


def await_step(
    worker: WorkerState, future: Future[tuple[Any, float]], *, users_code: bool = False, what: str = ""
) -> tuple[Any, float] | Inbound | None:
    """The step's result; a controller message if one came while the step hung; None if the step raised.
    ``users_code``: the future runs the user's data and step, whose own errors end the run. ``what``: what
    the future does, for the log (default: the next step)."""
    what = what or f"step {worker.step + 1}"
    lapsed = False
    long_after = time.monotonic() + worker.file_after_s if users_code and worker.file_after_s > 0 else math.inf
    woken = worker.link.arrived  # by a message or a lease, and by the future's end
    future.add_done_callback(lambda _: woken.set())
    while True:
        woken.clear()  # before the look: what comes after it wakes the wait
        if future.done():
            break
        if not worker.link.leased() and not lapsed:
            lapsed = True  # a step blocked in a collective cannot be stopped; its replica is not written
            log.warning("worker %d: no lease from the controller during step %d", worker.worker, worker.step + 1)
        now = time.monotonic()
        if now >= long_after:
            long_after = math.inf
            _write_held_step(worker)
        while defer_head(worker):
            pass  # a planned Form is kept for its step boundary; a message behind it is looked at too
        if not worker.link.inbox.empty():
            break  # a message while the step runs: the step gets its grace, then the message is answered
        lease_ends = math.inf if lapsed else worker.link.lease_until
        timeout = min(lease_ends, long_after) - now
        woken.wait(None if math.isinf(timeout) else max(timeout, 0.0))
    if future.done():
        try:
            return future.result()
        except Exception as exc:
            failure = classify(exc, step=worker.step + 1, in_group=True, source="worker")
            if users_code and isinstance(failure, StepFailed):
                # The same data and program would fail again in any group: the run ends, not this worker.
                log.exception("step %d failed in the user's code; reporting it to the controller", worker.step + 1)
                worker.report_failure(failure, traceback.format_exc())
            elif isinstance(failure, ProcessLost):
                # A collective (the step's, the handlers' boundary agreement, a restore's) met a dead peer: the
                # peer's loss, which the controller reports, not a failure of what ran here.
                log.warning(
                    "%s was cut off by a lost peer (%s: %s); waiting for the group to re-form",
                    what,
                    type(exc).__name__,
                    exc,
                )
            else:
                log.error("%s failed: %s: %s; waiting for the group to re-form", what, type(exc).__name__, exc)
            # Its traceback holds the failed step's frames, whose arrays hold the old group's backend: without
            # this, a survivor whose step failed kept that backend after the re-forming, and the collection that
            # follows it (forming.py) did not free it (bench_after_loss.py; which references close the loop is
            # not known).
            exc.__traceback__ = None
            return None
    try:
        return future.result(timeout=_grace(worker))
    except FutureTimeout:
        # Blocked in a collective with a dead peer. Leave the thread behind: its gloo operation fails once
        # another survivor's old backend is freed (its sockets close), or at the latest at the collective
        # timeout (runtime/compat/xla.py); the old group's backend it holds goes with it.
        log.warning("abandoning %s, blocked in a collective; re-forming", what)
        worker.abandoned.append(future)
        future.add_done_callback(lambda done: _abandoned_ended(what, done))
        worker.step_pool.shutdown()
        worker.step_pool = StepThread()
        return worker.link.inbox.get()
    except Exception as exc:  # failed within the grace: the group re-forms all the same
        exc.__traceback__ = None
        return worker.link.inbox.get()


def _write_held_step(worker: WorkerState) -> None:
    """A step runs long (``Form.file_after_s``): write the committed step before it to the replica file, if the
    cadence skipped it. Stuck in a deadlock, every member may be judged hung and replaced; the group then
    restores from the files, and a sparse cadence would have sent it back up to ``file_every - 1`` steps. The
    main thread is free, and the step's arrays are whole: only the step thread is blocked."""
    held = worker.ram
    if held is None or held.step == worker.replicas.submitted or not worker.link.leased():
        return
    log.info(
        "worker %d: step %d runs long; writing step %d to its replica file", worker.worker, held.step + 1, held.step
    )
    worker.replicas.save(held)


def _abandoned_ended(what: str, done: Future[Any]) -> None:
    """In the abandoned thread, as it ends: log how, and free the old group's backend its frames held."""
    error = done.exception()
    if error is None:
        log.info("the abandoned %s ended: it finished", what)
        return
    log.info("the abandoned %s ended: %s: %s", what, type(error).__name__, str(error)[:200])
    error.__traceback__ = None  # as in await_step: the step's frames hold the old backend
    gc.collect()  # and so may cycles (runtime/cluster/worker/forming.py); this thread is off the steps' path


def defer(worker: WorkerState, message: Inbound) -> bool:
    """Keep a planned Form (``at_step`` ahead) for its step boundary; True if ``message`` was kept."""
    if isinstance(message, Form | Stop) and message.at_step > worker.step:
        worker.deferred = message
        return True
    return False


def _inbox_head(worker: WorkerState) -> Inbound | None:
    """The controller's next message, left in the inbox."""
    with worker.link.inbox.mutex:
        return worker.link.inbox.queue[0] if worker.link.inbox.queue else None


def _grace(worker: WorkerState) -> float:
    """How long the step in flight may still take once a controller message came: a drain's hold lets it finish
    (every member that entered it finishes it, unless a peer never did), a re-forming abandons it soon."""
    head = _inbox_head(worker)
    if isinstance(head, Stop) and head.hold:
        return max(_HOLD_GRACE_MIN_S, _HOLD_GRACE_STEPS * (worker.core.step_s or 0.0))
    return _ABANDON_GRACE_S


def defer_head(worker: WorkerState) -> bool:
    """While a step runs: take a planned Form off the inbox (the step must finish); True if one was."""
    head = _inbox_head(worker)
    if isinstance(head, Form | Stop) and head.at_step > worker.step:
        return defer(worker, worker.link.inbox.get())
    return False
