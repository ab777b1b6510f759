"""A worker's training loop, on the step core the single-process executor drives too (``core/step_core.py``: what a
step reads, its checks, its loss and metrics, a commit's order). What a group adds is here: each step runs in the
step thread, where a dead peer's collective can be abandoned; the slices' copies of its new state are compared
where they are (silent data corruption: a step that differs is run again or its suspects replaced, never
committed); a commit keeps the RAM replica, the neighbour copy and the replica file, and a durable write when due;
what the script's handlers asked applies at each boundary; and at the target the final state's digest is gathered
for ``Finished``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from elastic_runtime.cluster.protocol import EventReport, Finished, Message
from elastic_runtime.cluster.worker.boundary import Boundary
from elastic_runtime.cluster.worker.durable import agree_durable, due_durable, group_digest, save_durable
from elastic_runtime.cluster.worker.group import meet
from elastic_runtime.cluster.worker.link import Inbound
from elastic_runtime.cluster.worker.state import WorkerState
from elastic_runtime.cluster.worker.stepping import await_step, defer, wait_fenced
from elastic_runtime.core.classify import classify
from elastic_runtime.core.events import CorruptionHealed, SilentCorruption
from elastic_runtime.core.executor import RunResult
from elastic_runtime.core.fingerprint import Healed, Integrity, StateDiverged, read_digests
from elastic_runtime.core.job import PyTree
from elastic_runtime.core.memory import can_hold
from elastic_runtime.core.mesh import device_ids
from elastic_runtime.core.process_data import place_batch
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.replicas import device_replica, replica

if TYPE_CHECKING:
    from jax.sharding import Mesh


__all__ = ["apply_boundary", "compare_slices", "final_state", "finish", "in_step_thread", "run_step", "train"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long the final gather waits for every member's last durable write (as long as a restore's reads may take).
_GATHER_MEET_S = 600.0


def train(worker: WorkerState, target: int) -> Inbound | None:
    """Run steps until ``target``, or until the controller sends something; returns that message."""
    assert worker.ram is not None
    position = worker.core.data_position
    last_digest = ""  # the final state's, when its durable checkpoint took it already (every member alike)
    while worker.step < target:
        if worker.deferred is not None and worker.step >= worker.deferred.at_step:
            form, worker.deferred = worker.deferred, None
            return form
        if not worker.link.inbox.empty():
            message = worker.link.inbox.get()
            if not defer(worker, message):
                return message
        if not worker.link.leased():
            heard = wait_fenced(worker)
            if heard is not None:
                return heard
        began = time.perf_counter()
        waited = 0.0  # in the iteration's collectives, where a worker waits for its slowest peer
        if worker.durable_due is not None and worker.durable_due[0] != worker.generation:
            worker.durable_due = None  # the group re-formed: every member dropped it (a newcomer never had it)
        if worker.durable_due is not None:
            agreed = in_step_thread(worker, agree_durable, "the durable writers' agreement (a collective of the group)")
            if isinstance(agreed, Message) or agreed is None:
                return agreed if isinstance(agreed, Message) else None
            waited = time.perf_counter() - began  # a collective, and the writers' copy: their role's work
        if worker.script is not None:
            handled = await_step(
                worker,
                worker.step_pool.submit(worker.script.boundary, worker),
                what="the step boundary of the script's handlers (an all-gather of the group)",
            )
            if isinstance(handled, Message) or handled is None or handled[0].stop:
                return handled if isinstance(handled, Message) else None
            apply_boundary(worker, handled[0])
            waited = time.perf_counter() - began
        future = worker.step_pool.submit(run_step, worker, worker.core.state, position, worker.step + 1)
        outcome = await_step(worker, future, users_code=True)
        if isinstance(outcome, Message):
            return outcome
        if outcome is None:  # the step raised: not committed; wait for the controller to re-form
            return None
        (new_state, moved, loss, metrics, in_program, found), seconds = outcome
        if isinstance(found, StateDiverged):  # not committed: nothing corrupted is ever kept or written
            report_corruption(worker, found)
            if found.persistent:
                return None  # the controller replaces the suspects' workers; the group restores the step before
            continue  # a transient flip: the step again, from the state before it
        if found is not None:
            report_corruption(worker, found)
        worker.pace.record(worker.generation, worker.step + 1, began, waited + in_program)
        step, position = worker.step + 1, position + 1
        leased = worker.link.leased()  # cut off, this worker may have been replaced: its files must not compete
        keep = partial(keep_copies, worker, step, position, new_state, moved, leased)
        # Committed, and so named in the heartbeats, only once its copies are kept: a group that counts this step
        # committed then finds the step before it in every member's files. (Counted before the wait, a member
        # killed there left files two steps behind its peers', which keep two: no step was whole in the slice.)
        due = worker.core.commit(
            step, new_state, loss=loss, metrics=metrics, seconds=seconds, data_position=position, keep=keep
        ).due
        if worker.durable is not None and "durable" in due:
            if leased:
                worker.replicas.pin(worker.step)
            if worker.step < target:
                # Every member, leased or not: the writers' agreement is a collective at the next boundary.
                due_durable(worker, worker.step)
            else:  # the run's last step: written whatever waits; it replaces a due step still waiting
                worker.durable_due = None
                writing = time.perf_counter()
                # Every member, leased or not: a collective, abandoned like a step if a peer dies in it.
                digest = in_step_thread(worker, group_digest, "the last step's digest (a collective of the group)")
                if isinstance(digest, Message) or digest is None:
                    return digest if isinstance(digest, Message) else None
                last_digest = digest[0]
                if leased and worker.process_id < worker.slice_size:  # the first slice writes the checkpoint
                    save_durable(worker, forced=True, digest=last_digest)
                worker.pace.exclude(time.perf_counter() - writing)  # its role's work, not a slower pace
        worker.heartbeat()
        if worker.collect_in is not None:
            worker.collect_in -= 1
            if worker.collect_in <= 0:  # the old group's backend, if cycles still hold it (forming.py)
                worker.collect_in = None
                gc.collect()
    # The gather is a collective: a peer lost now must not leave this worker deaf to the next Form.
    outcome = await_step(
        worker, worker.step_pool.submit(final_state, worker, last_digest), what="the final state's digest"
    )
    if isinstance(outcome, Message) or outcome is None:
        return outcome
    finish(worker, target, outcome[0])
    return None


def keep_copies(
    worker: WorkerState, step: int, position: int, new_state: PyTree, moved: Any, leased: bool, due: tuple[str, ...]
) -> None:
    """A step's copies, kept before it counts as committed: the RAM replica (on the devices: its host copy is made
    by the replica file's writer, so that the next step need not wait for it), the neighbour's copy the step's
    shift brought, and the replica file when ``due`` names it (never by a worker whose lease lapsed: it may have
    been replaced, and its files must not compete)."""
    metadata = worker.identity | worker.layout
    generation = worker.generation
    back = worker.spares.hand_back(generation) if worker.spares.on else None
    worker.ram = device_replica(
        step, position, new_state, worker.local_like, metadata, generation=generation, on_unread=back
    )
    if worker.shift is not None:
        neighbour = worker.shift.copy(moved, worker.ram.tree)
        worker.neighbour = replica(step, position, neighbour, generation=generation)
    if leased and {"file", "durable"} & set(due):
        worker.replicas.save(worker.ram)  # after the previous step's file is written


def in_step_thread(worker: WorkerState, fn: Callable[[WorkerState], T], what: str) -> tuple[T, float] | Inbound | None:
    """``fn(worker)`` run in the step thread and waited for as a step is (``await_step``): a collective of the group
    that a dead peer leaves blocked is abandoned, and a message from the controller meanwhile comes back instead."""
    return await_step(worker, worker.step_pool.submit(lambda: (fn(worker), 0.0)), what=what)


def compare_slices(integrity: Integrity, mesh: Mesh, step: int, digests: Any) -> Healed | StateDiverged | None:
    """The slices' copies of ``step``'s new state compared: every member's digests, computed and gathered by the
    step's own program in every member (``StepCompiler(fingerprint=...)``), so each reaches the same verdict; a
    divergence is returned, not raised, so that the step thread reports no failure."""
    try:
        return integrity.verdict(read_digests(digests, mesh), mesh, step)
    except StateDiverged as diverged:
        return diverged


def report_corruption(worker: WorkerState, found: StateDiverged | Healed) -> None:
    """The lead tells the controller what the fingerprints found (every member found the same): a divergence,
    with the processes that hold its suspect devices, or the replay that healed it."""
    if worker.process_id != 0:
        return
    step = worker.step + 1
    if isinstance(found, Healed):
        suspects, seconds = found.divergence.suspects, found.seconds
        healed = CorruptionHealed(step=step, source="worker", kind="transient", suspects=suspects, seconds=seconds)
        log.warning("step %d replayed: the slices agree again (a transient corruption)", step)
        worker.link.send(EventReport(worker=worker.worker, generation=worker.generation, event=healed))
        return
    event = classify(found, step=step, in_group=True, source="worker")
    assert isinstance(event, SilentCorruption)
    owner = {d.id: d.process_index for d in worker.mesh.devices.flat}
    processes = tuple(sorted({owner[d] for d in found.divergence.suspects}))
    log.error("%s; processes %s", found, list(processes))
    report = EventReport(worker=worker.worker, generation=worker.generation, event=event, processes=processes)
    worker.link.send(report)


def apply_boundary(worker: WorkerState, done: Boundary) -> None:
    """What the script's handlers asked at this boundary: a new state, a durable checkpoint of the step."""
    if done.state is not None:
        worker.core.state = done.state
    if done.checkpoint and worker.durable is not None:
        cadence = worker.core.ledger.policies.get("durable")
        if worker.step in worker.durable_steps or (
            cadence is not None and cadence.should_save(worker.step, worker.step - 1)
        ):
            # Written (or due) already: writing a committed step's files again could damage it.
            log.info("checkpoint asked for at step %d: it is a durable step already", worker.step)
            return
        # In every member, leased or not: what is due next, and whether the writers must agree on a waiting step.
        worker.core.ledger.taken("durable", worker.step)
        worker.durable_due = None  # an older due step still waiting: this newer one replaces it
        if not worker.link.leased():
            return  # it may have been replaced: its files must not compete
        worker.replicas.pin(worker.step)
        if worker.process_id < worker.slice_size:  # the first slice writes the group's checkpoint
            save_durable(worker, forced=True)  # asked for: never dropped


def run_step(
    worker: WorkerState, state: PyTree, position: int, step: int
) -> tuple[tuple[PyTree, Any, float | None, dict[str, float], float, Healed | StateDiverged | None], float]:
    """The step, its neighbour shift, its loss as a number, every scalar metric it returned (the metrics are
    replicated: every process has them), the seconds spent in its programs (collectives included) and, where the
    slices are compared, what comparing them found (``compare_slices``)."""
    # The group's, read now: a step abandoned in a dead peer's collective may end after the group re-formed.
    integrity, mesh = worker.integrity, worker.mesh
    started = time.perf_counter()
    batch, worker.batch_bytes = place_batch(
        worker.job.data, position, worker.batch_shardings, worker.batch_like, worker.batch_rows
    )
    entered = time.perf_counter()
    # The new state is written into a spare state's buffers; compared, the step returns its digests too.
    spare = (worker.spares.take(state),) if worker.spares.on else ()
    new_state, metrics, *digests = worker.core.launch(worker.compiled, state, step, batch, *spare)
    ready, loss, scalars = worker.core.results(step, new_state, metrics, device_ids(mesh))
    in_program = ready - entered
    found = compare_slices(integrity, mesh, step, digests[0]) if integrity is not None else None
    # The neighbour replica's permute is a collective too: it runs here, where a dead peer's hang is abandoned.
    # Not for a state that is not committed (every member found the same divergence: none runs it).
    shifted = time.perf_counter()
    moved = worker.shift(new_state) if worker.shift is not None and not isinstance(found, StateDiverged) else []
    in_program += time.perf_counter() - shifted
    return (new_state, moved, loss, scalars, in_program, found), time.perf_counter() - started


def final_state(worker: WorkerState, digest: str = "") -> tuple[tuple[str, PyTree | None], float]:
    """The final state's digest (``state_digest``, taken where its shards live: a collective of the group, so every
    member finishes together; ``digest``: taken already, for the last step's durable checkpoint), once this
    process's part of the final durable checkpoint is out (``Saved`` before ``Finished``, so the controller commits
    it); and, where the script asked for it (``run(gather=True)``, or the launch's ``--result``), the whole state in
    the lead, gathered leaf by leaf (a collective too: every member takes part, and the others let each leaf go).
    Asked for nothing, no process holds more than its shards."""
    import jax
    from jax.experimental import multihost_utils

    worker.durable_lane.wait()  # its failures are logged by the write
    meet(f"gather/{worker.generation}", _GATHER_MEET_S)  # the others' final writes may take longer
    digest = digest or group_digest(worker)
    if not worker.gather:
        return (digest, None), 0.0
    # Leaf by leaf: gathered at once, every worker held two more copies of the whole state (one per local device):
    # at a GB of state 4 workers ran the machine out of memory. Kept where the lead can hold it: a state larger than
    # its memory is gathered and dropped leaf by leaf (the heavy test's 3 GB state under a cgroup limit of 0.95 of
    # it: kept, it got the lead OOM-killed).
    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(worker.core.state))
    keep = worker.process_id == 0 and (bool(worker.settings.result) or can_hold(nbytes))
    if worker.process_id == 0 and not keep:
        log.warning(
            "the final state (%d MB) is more than this process can hold: run() returns it as None", nbytes >> 20
        )
    kept: list[np.ndarray] = []
    for leaf in jax.tree.leaves(worker.core.state):
        whole = np.ascontiguousarray(multihost_utils.process_allgather(leaf, tiled=True))
        if keep:
            kept.append(whole)
        del whole
    tree = jax.tree.unflatten(jax.tree.structure(worker.core.state), kept) if keep else None
    return (digest, tree), 0.0


def finish(worker: WorkerState, target: int, gathered: tuple[str, PyTree | None]) -> None:
    assert worker.ram is not None
    digest, whole = gathered
    result = worker.settings.result
    if result and whole is not None:  # in the disk tier's format: verified, and plain Orbax reads it
        final = replica(target, worker.ram.data_position, whole, worker.identity)
        DiskTier(result, name="result", check_space=False).save(final, timeout=600.0)
    # What the script's run() returns once the group is done (boot.py): the state in the lead only.
    worker.result = RunResult(
        state=None if whole is None else worker.keys.to_keys(whole),
        step=target,
        data_position=worker.ram.data_position,
        loss=worker.core.loss,
        mesh_history=list(worker.mesh_history),
        recoveries=max(worker.generation - 1, 0),
        mode="worker",
        lead=worker.process_id == 0,
        process_id=worker.process_id,
    )
    # The run's memory report ends at its last step: a few steps can run between two periodic beats.
    worker.heartbeat(memory=True)
    worker.link.send(Finished(worker=worker.worker, generation=worker.generation, step=target, digest=digest))
