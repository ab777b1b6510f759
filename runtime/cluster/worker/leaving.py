"""A worker told to go by its host leaves the group cleanly instead of dying as a lost worker.

Kubernetes (a node drain, a preemption), SLURM (``scancel``, a preempted job) and systemd deliver that as SIGTERM
with a grace period before SIGKILL; Ctrl-C as SIGINT. On either the worker tells the controller (``Leaving``) and
goes on stepping with the group until the controller's ``Stop``, which names the planned step the group re-forms
at without it (``runtime/cluster/controller/planned.py``); at that step it exits with the code the Stop names
(0 under ``launch``). With no ``Stop`` within its grace period (``ELASTIC_GRACE_S``: the controller gone, or
unable to plan the departure in time) it exits on its own with the code the signal would have ended it with
(128 + its number), and the controller counts a lost worker, as before. SIGKILL cannot be caught: it stays a
loss.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

from elastic_runtime.cluster.protocol import Leaving
from elastic_runtime.cluster.worker.link import ControllerLink

__all__ = ["leave_on_signal"]

log = logging.getLogger(__name__)


def leave_on_signal(link: ControllerLink, worker: int, grace_s: float) -> None:
    """From now on SIGTERM and SIGINT make this worker ask to leave (see the module's docstring). Call it after
    the ``Hello``: ``Leaving`` must not be the connection's first message. Only the main thread may set signal
    handlers; in any other the signals keep their default (a signalled worker is then a lost one)."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("worker %d does not run in the main thread: SIGTERM will end it as a lost worker", worker)
        return
    asked = threading.Event()

    def signalled(signum: int, frame: FrameType | None) -> None:
        # Python runs this in the main thread between two bytecodes, possibly inside ``link.send``, whose lock is
        # not reentrant: the message goes from a thread of its own.
        if asked.is_set():
            return  # a second signal changes nothing: the departure is under way
        asked.set()
        what = signal.Signals(signum)
        threading.Thread(target=_leave, args=(link, worker, what, grace_s), name="leaving", daemon=True).start()

    signal.signal(signal.SIGTERM, signalled)
    signal.signal(signal.SIGINT, signalled)


def _leave(link: ControllerLink, worker: int, what: signal.Signals, grace_s: float) -> None:
    log.warning("worker %d got %s: asking the controller to go on without it", worker, what.name)
    link.send(Leaving(worker=worker, signal=what.name))
    if link.stop_heard.wait(grace_s):
        return  # the worker's loop exits on that Stop, at the step it names
    log.error("worker %d: no Stop from the controller within %.1f s of %s; exiting", worker, grace_s, what.name)
    sys.stdout.flush()
    sys.stderr.flush()
    # As run_worker ends: abandoned step threads may be blocked inside XLA, so no interpreter shutdown.
    os._exit(128 + what.value)
