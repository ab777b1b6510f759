"""A worker's part of the group's durable checkpoints: written in the background after a durable step commits, and
the drain's final one, written before the process exits (``Stop.durable_step``).

The writes run in a lane (``storage/lane.py``, as the one-process cascade's tiers): a step that comes due while the
previous write still runs waits for it (its replica file is pinned, so it is read back from there, not held in
memory) and is written when that write ends, unless a newer due step replaced it or the group re-formed: the
durable tier is at most one write behind, its cadence stretched to the write's time, and the lead reports how far
behind it is (``CheckpointBehind``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_runtime.cluster.protocol import EventReport, Saved
from elastic_runtime.core.errors import CheckpointInvalid
from elastic_runtime.core.events import CheckpointBehind
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.lane import Lane
from elastic_runtime.storage.manifest import describe_leaves

if TYPE_CHECKING:
    from elastic_runtime.cluster.worker.state import WorkerState

__all__ = ["Part", "durable_lane", "final_durable", "save_durable"]

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


def durable_lane(worker: WorkerState) -> Lane[Part]:
    """The worker's lane of durable writes (``storage/lane.py``): one at a time, a due part waiting while one runs."""
    return Lane(
        "durable",
        lambda part: _write(worker, part),
        step_of=lambda part: part.step,
        on_skip=lambda step, why: log.info("durable checkpoint of step %d not written: %s", step, why),
        on_wait=lambda step, writing: _behind(worker, step, writing),
    )


def save_durable(worker: WorkerState, *, forced: bool, snapshot: HostSnapshot | None = None) -> None:
    """Write this process's part of the durable checkpoint of the step just committed (or of ``snapshot``),
    in the background. One due while the previous write runs waits for it, read back from its replica file (pinned
    by the caller) when its turn comes, not held in memory; a ``forced`` one (the run's last step, a checkpoint
    asked for) is queued behind it with its host copy made now, and never replaced by a due one."""
    assert worker.ram is not None and worker.durable is not None
    snapshot = snapshot or worker.ram
    waits = worker.durable_lane.busy() and not forced
    if waits:
        step = snapshot.step
        load: Callable[[], HostSnapshot] = lambda: _from_file(worker, step)  # noqa: E731
    else:
        # Its host copy made here, not in the write: the write may outlive the backend the arrays are on.
        snapshot.tree  # noqa: B018 - the first read makes the copy
        load = lambda: snapshot  # noqa: E731
    part = Part(snapshot.step, worker.generation, load, worker.owned, worker.state_shardings, waits)
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
        metadata=worker.identity if lead else {},
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
