"""A worker's part of the group's durable checkpoints: written in the background after a durable step commits, and
the drain's final one, written before the process exits (``Stop.durable_step``).

The writes run in a lane (``storage/lane.py``, as the one-process cascade's tiers). A step that comes due while a
writer's previous write still runs waits (its replica file is pinned, so it is read back from there, not held in
memory), and is written once every writer's previous write has ended, unless a newer due step replaced it or the
group re-formed: the durable tier is at most one write behind, its cadence stretched to the slowest writer's
write, and the lead reports how far behind it is (``CheckpointBehind``). Every writer must write the same steps (a
step is whole only with every part), and when each one's write ends is its own: so they agree, at each step
boundary while a due step waits, with one small collective of the group (``agree_durable``), and start it at the
same boundary. Before, each writer took the newest due step when its own write ended, and writers that ended
on either side of a due step wrote different steps, none of them whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_runtime.cluster.protocol import EventReport, Saved
from elastic_runtime.cluster.worker.state import WorkerState
from elastic_runtime.core.errors import CheckpointInvalid
from elastic_runtime.core.events import CheckpointBehind
from elastic_runtime.core.fingerprint import STATE_DIGEST, state_digest
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.lane import Lane
from elastic_runtime.storage.manifest import describe_leaves

__all__ = ["Part", "agree_durable", "due_durable", "durable_lane", "final_durable", "group_digest", "save_durable"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Part:
    """This process's part of the durable checkpoint of ``step``, as the lane writes it: the layout captured when
    it came due (the write runs on while a re-forming group may be without a backend), and where its host copy
    comes from (``load``: the copy made then, or, for a part that waited, its pinned replica file)."""

    step: int
    generation: int
    load: Callable[[], HostSnapshot]
    owned: list[bool]
    shardings: Any
    waited: bool
    digest: str = ""  # the state's digest on the devices at that step (core/fingerprint.py), if taken


def durable_lane(worker: WorkerState) -> Lane[Part]:
    """The worker's lane of durable writes (``storage/lane.py``): one at a time; a due part is submitted only when
    every writer's lane is free (``agree_durable``), a forced one waits behind the write in progress."""
    return Lane(
        "durable",
        lambda part: _write(worker, part),
        step_of=lambda part: part.step,
        on_skip=lambda step, why: log.info("durable checkpoint of step %d not written: %s", step, why),
    )


def due_durable(worker: WorkerState, step: int) -> None:
    """``step`` is due for a durable checkpoint (every member calls this at the same step): it waits for the
    writers' agreement at the next boundary, replacing one due before it that still waits."""
    if worker.durable_due is not None and worker.durable_due[0] == worker.generation:
        log.info("durable checkpoint of step %d not written: replaced by step %d", worker.durable_due[1], step)
    worker.durable_due = (worker.generation, step, False)


def agree_durable(worker: WorkerState) -> bool:
    """At a step boundary, in the step thread (a collective, abandoned like a step): whether every writer is
    free, and then this writer's part of the waiting due step is started. False: it waits on (the lead says so
    once)."""
    assert worker.durable_due is not None
    generation, step, told = worker.durable_due
    writer = worker.process_id < worker.slice_size  # the first slice writes the group's checkpoint
    # A writer without its lease may have been replaced: its files must not compete, so the step waits.
    busy = writer and (worker.durable_lane.busy() or not worker.link.leased())
    if not worker.group_minimum(0 if busy else 1):
        if not told:
            _behind(worker, step, worker.durable_last)
            worker.durable_due = (generation, step, True)
        return False
    worker.durable_due = None
    # On the devices still (no step since): every member takes its part of the digest, a collective too.
    digest = group_digest(worker) if step == worker.step else ""
    if writer:
        save_durable(worker, forced=False, step=step, digest=digest)
    return True


def group_digest(worker: WorkerState) -> str:
    """The whole state's digest (``state_digest``), taken where its shards live: a collective of the group, called by
    every member at the same point. The lead records it in the durable checkpoint's manifest, and a restore that
    reads the checkpoint whole (the disk or GCS tier) checks the state it read against it."""
    return f"{state_digest(worker.core.state):08x}"


def save_durable(
    worker: WorkerState,
    *,
    forced: bool,
    step: int | None = None,
    snapshot: HostSnapshot | None = None,
    digest: str = "",
) -> None:
    """Write this process's part of the durable checkpoint of ``step`` (default: the step just committed, or
    ``snapshot``'s) in the background. A step older than the RAM replica (one that waited for the writers'
    agreement) is read back from its replica file, pinned by the caller, in the write's thread; a ``forced`` one
    (the run's last step, a checkpoint asked for) is queued behind the write in progress, never replaced."""
    assert worker.ram is not None and worker.durable is not None
    snapshot = snapshot or worker.ram
    step = snapshot.step if step is None else step
    waited = step != snapshot.step
    if waited:
        load: Callable[[], HostSnapshot] = lambda: _from_file(worker, step)  # noqa: E731
    else:
        # Its host copy made here, not in the write: the write may outlive the backend the arrays are on.
        snapshot.tree  # noqa: B018 - the first read makes the copy
        load = lambda: snapshot  # noqa: E731
    part = Part(step, worker.generation, load, worker.owned, worker.state_shardings, waited, digest)
    worker.durable_lane.submit(part, forced=forced)


def _from_file(worker: WorkerState, step: int) -> HostSnapshot:
    worker.replicas.wait()  # its file was written by now, or is being written
    return worker.replicas.read(step, [worker.replicas.tier], worker.local_like)


def _write(worker: WorkerState, part: Part) -> None:
    if part.waited and part.generation != worker.generation:
        log.info("durable checkpoint of step %d not written: the group re-formed while it waited", part.step)
        return
    worker.durable_last = part.step
    store, lead = worker.durable, worker.process_id == 0
    assert store is not None
    try:
        snapshot = part.load()
        files = store.write(
            part.step, snapshot.tree, worker.template, part.shardings, owned=part.owned, lead=lead,
            process=worker.process_id,
        )  # fmt: skip
    except Exception as exc:  # a failed write leaves the previous checkpoint; the controller commits nothing new
        log.error("durable checkpoint write of step %d failed: %s: %s", part.step, type(exc).__name__, exc)
        return
    structure, leaves = describe_leaves(worker.template) if lead else ("", ())
    saved = Saved(
        worker=worker.worker,
        generation=part.generation,
        step=part.step,
        data_position=snapshot.data_position,
        files=tuple(files),
        structure=structure,
        leaves=leaves,
        metadata=(worker.identity | ({STATE_DIGEST: part.digest} if part.digest else {})) if lead else {},
    )
    worker.link.send(saved)


def _behind(worker: WorkerState, step: int, writing: int) -> None:
    lag = step - max(worker.durable_committed, 0)
    log.info("durable checkpoint of step %d waits for the write of step %d (%d steps behind)", step, writing, lag)
    if worker.process_id == 0:  # one report for the group's checkpoint, not one per writer
        behind = CheckpointBehind(step=step, tier="durable", writing=writing, behind_steps=lag)
        worker.link.send(EventReport(worker=worker.worker, generation=worker.generation, event=behind))


def final_durable(worker: WorkerState, step: int) -> None:
    """The drain's durable checkpoint (``Stop.durable_step``): this process's part of ``step``, its newest
    committed step or, when a peer held one step behind, the one before from its replica file; written (and
    its ``Saved`` sent) before the process exits."""
    if worker.durable is None or worker.ram is None or worker.process_id >= worker.slice_size:
        return  # not a writer of the group's checkpoints
    worker.durable_lane.wait()
    if worker.durable_last == step:
        return  # written already: its Saved is out
    snapshot = worker.ram
    if worker.ram.step != step:
        try:
            snapshot = _from_file(worker, step)
        except CheckpointInvalid as exc:
            log.error("worker %d: no replica of step %d for the final checkpoint: %s", worker.worker, step, exc)
            return
    log.info("worker %d writes its part of the final durable checkpoint of step %d", worker.worker, step)
    save_durable(worker, forced=True, snapshot=snapshot)
    worker.durable_lane.wait()
