"""The worker side of a multi-process run: the loop each process of ``elastic-runtime launch`` runs.

A training script hands its :class:`~elastic_runtime.core.job.TrainJob` to :func:`run_worker`; everything else comes
from the controller through the environment (its address, this worker's id, where replica files live) and over
the wire (which group to form, which step to restore from whom).

The layout: ``data`` is the replica axis across slices of processes and ``model`` spans the devices of a
slice's processes (:mod:`elastic_runtime.storage.boxes`); with one process per slice each process holds the whole
state. Every committed step's own shards are copied to host memory (the RAM replica) and, in the background, to a
replica file in ``/dev/shm``; with neighbour replicas, the previous process's shards are copied to host memory too.

Re-forming in-process (measured on jax 0.10.2, CPU, gloo): when a peer is killed, a step blocked in a gloo
collective never returns and raises nothing, even after JAX's own heartbeat timeout. The worker therefore
runs each step in a thread and, when the controller sends :class:`~elastic_runtime.cluster.protocol.Form` while a step
is still running, abandons that thread (it stays blocked; it is never joined), shuts ``jax.distributed`` down, clears
the backends and joins the new group. With ``jax_enable_recoverability`` on, this works in the same process.
Because abandoned threads are blocked inside XLA, the process ends with ``os._exit`` after flushing.

This module holds the :class:`Worker`'s message loop and its heartbeat thread; its state is
:class:`~elastic_runtime.cluster.worker.state.WorkerState` (``state.py``), and what each message starts is in its own
module, a function over that state: ``forming`` (joining a group), ``restore`` (what it holds and the group's
restore), ``training`` (the steps and their commit), ``stepping`` (the step thread it may abandon) and ``durable``
(its part of the durable checkpoints).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from elastic_runtime.cluster.protocol import Form, Hello, Message, RestoreStep, Stop, Warm
from elastic_runtime.cluster.worker.durable import durable_lane, final_durable
from elastic_runtime.cluster.worker.forming import form_group, warm_up
from elastic_runtime.cluster.worker.instance import instance_name
from elastic_runtime.cluster.worker.leaving import leave_on_signal
from elastic_runtime.cluster.worker.link import Inbound
from elastic_runtime.cluster.worker.refill import adopt_restored, restore_step
from elastic_runtime.cluster.worker.smaller import SmallerGroup
from elastic_runtime.cluster.worker.state import WorkerState
from elastic_runtime.cluster.worker.stepping import await_step
from elastic_runtime.cluster.worker.training import train

log = logging.getLogger(__name__)

# A heartbeat this late is logged: with the 0.2 s interval its silence is then past half the controller's 0.8 s
# default timeout, and the log says whether a worker declared silent had stopped sending (its heartbeat thread
# waited for the GIL or a CPU) or was read late.
_LATE_BEAT_S = 0.2


class Worker(WorkerState):
    """One worker process: its state (:class:`~elastic_runtime.cluster.worker.state.WorkerState`) and its message
    loop. Build it with :func:`run_worker`."""

    def serve(self) -> int:
        """Handle controller messages until told to stop; returns the exit code."""
        # The parts that run in threads of their own, built with the loop that feeds them.
        self.durable_lane = durable_lane(self)
        self.smaller = SmallerGroup()
        events = self.script.events if self.script is not None else ()
        where = instance_name(self.settings)
        self.link.send(
            Hello(
                worker=self.worker,
                pid=os.getpid(),
                target_steps=self.target_steps,
                events=events,
                instance=where,
                settings=self.script_settings,
            )
        )
        leave_on_signal(self.link, self.worker, self.settings.grace_s)  # a node drain is a departure, not a loss
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()
        pending: Inbound | None = None
        while True:
            message = pending if pending is not None else self.link.inbox.get()
            pending = None
            match message:
                case Form() if self.in_a_group.is_set() and message.generation <= self.generation:
                    # Joined already: a departure that died before its planned step makes the controller tell
                    # the members still stepping to join at once, and this one may have reached that step and
                    # joined in between. Joining the same coordination service twice ends the process.
                    log.info(
                        "worker %d: already in generation %d; its Form again ignored", self.worker, self.generation
                    )
                case Form():
                    form_group(self, message)
                case RestoreStep() if message.generation == self.generation:
                    # The restore is a collective too: if a peer dies during it, abandon it like a step. Its
                    # thread only returns what it restored; the worker's state is set here, by this thread.
                    abandoned = threading.Event()
                    future = self.step_pool.submit(restore_step, self, message, self.files, abandoned)
                    self.files = {}
                    outcome = await_step(self, future, what=f"the restore of step {message.step}")
                    if isinstance(outcome, Message):
                        abandoned.set()
                        self.abandoned_restore = future
                        pending = outcome
                    elif outcome is not None:
                        adopt_restored(self, message, outcome[0])
                        if self.form is not None:
                            self.smaller.start(self, self.form)
                        # Held here through training, the restored state and its host copy were two more
                        # copies of this process's shards for the whole run (docs/multiprocess.md, memory).
                        del outcome, future
                        pending = train(self, message.target_steps)
                case RestoreStep():
                    log.info("stale restore for generation %d ignored", message.generation)
                case Warm(programs=programs) if not self.in_a_group.is_set():
                    warm_up(self, programs)
                case Warm():
                    pass
                case Stop(hold=True):
                    log.info("worker %d holds at step %d: %s", self.worker, self.step, message.reason)
                    self.held = True
                    self.heartbeat()  # says the step it holds at
                case Stop(reason=reason, exit_code=code):
                    log.info("worker %d stops (exit code %d): %s", self.worker, code, reason)
                    self.stopped_by = message
                    self.smaller.stop()
                    if message.durable_step >= 0:
                        final_durable(self, message.durable_step)
                    return code

    def _beat(self) -> None:
        due = time.monotonic()
        while not self.ended.is_set():
            late = time.monotonic() - due
            if late > _LATE_BEAT_S:
                log.warning("worker %d: heartbeat %.2f s late (waited for the GIL or a CPU)", self.worker, late)
            self.heartbeat(memory=True)
            due = time.monotonic() + self.settings.heartbeat_s
            self.ended.wait(self.settings.heartbeat_s)
