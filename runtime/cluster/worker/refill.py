"""A worker's restore: what it holds (the inventory it reports in ``Joined``: RAM, its replica files, the group's
durable checkpoints) and the group's restore of one step (the read chain over those sources, fastest first,
each damaged one reported as ``CheckpointCorrupt``; then the collective that hands every member the source slice's
shards).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from elastic_runtime.cluster.protocol import EventReport, Restored, RestoreStep
from elastic_runtime.cluster.tiers import Tier
from elastic_runtime.cluster.worker.group import meet
from elastic_runtime.cluster.worker.state import WorkerState
from elastic_runtime.core import restore as core_restore
from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable, StorageError
from elastic_runtime.core.events import CheckpointCorrupt
from elastic_runtime.core.initial import initial_program
from elastic_runtime.core.job import PyTree
from elastic_runtime.core.restore import CorruptionListener
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.boxes import local_copy
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.replicas import MAX_PINS, replica

__all__ = [
    "Restoration",
    "adopt_restored",
    "best_local",
    "list_durable_steps",
    "local_steps",
    "read_durable",
    "read_own",
    "report_unreadable",
    "restore_step",
]

log = logging.getLogger(__name__)

# A read of this process's shards from its replica files or the durable tier (each has its own deadline too).
_READ_TIMEOUT_S = 600.0


def best_local(worker: WorkerState, read_files: bool) -> tuple[int, Tier]:
    """The newest step this process can restore and from where. The steps its replica files hold go in
    ``files`` (only their manifests are read here: the data of the one restored is read by ``restore_step``),
    the group's committed durable checkpoints in ``durable_steps``."""
    worker.files = {}
    if read_files:  # a restarted worker, a resumed run, or a slice that may need to roll back
        try:
            worker.files = worker.replicas.listed(
                worker.identity | worker.layout,
                max_step=worker.target_steps,
                fences=worker.fences,
                # One process a slice: its newest is its slice's best. Else an older step may be the one
                # the whole slice holds (a peer's newest write did not finish, or only the durable tier
                # holds a lost process's shards): the keep=2 newest and those pinned for durable steps.
                limit=1 if worker.slice_size == 1 else 2 + MAX_PINS,
            )
        finally:
            worker.skipped = tuple(worker.replicas.skipped)
    worker.durable_steps = list_durable_steps(worker)
    if worker.ram is not None:
        return worker.ram.step, Tier.RAM
    if worker.files:
        return max(worker.files), worker.files_tier
    if worker.durable_steps:
        return max(worker.durable_steps), Tier.DURABLE
    return 0, Tier.NONE


def local_steps(worker: WorkerState) -> set[int]:
    """The steps it can restore from its own memory or replica files."""
    return set(worker.files) | ({worker.ram.step} if worker.ram is not None else set())


def list_durable_steps(worker: WorkerState) -> set[int]:
    """This run's committed durable checkpoints (any layout: every process reads its own shards)."""
    if worker.durable is None:
        return set()
    found = set()
    try:
        steps = worker.durable.steps()
    except StorageError as exc:  # unreachable now: the group restores from what else it holds
        log.warning("cannot list the durable checkpoints: %s", exc)
        return set()
    for step in steps:
        try:
            metadata = worker.durable.manifest(step).metadata
        except (CheckpointInvalid, SnapshotUnavailable, StorageError) as exc:
            log.warning("durable checkpoint of step %d not usable: %s", step, exc)
            continue
        fence = worker.fences.get(int(metadata.get("generation", "0")))
        if fence is not None and step > fence:
            log.warning("durable checkpoint of step %d: its generation was fenced at step %d; skipped", step, fence)
        elif step <= worker.target_steps and all(metadata.get(k) == v for k, v in worker.identity.items()):
            found.add(step)
    return found


def restore_step(
    worker: WorkerState, restore: RestoreStep, files: dict[int, list[DiskTier]], abandoned: threading.Event
) -> tuple[Restoration, float]:
    """Read this process's shards of ``restore.step`` (when the source slice needs them) and take part in the
    group's restore. Runs in the step thread and changes nothing of the worker's: ``adopt_restored`` does."""
    import jax

    if restore.source < 0:
        state = (worker.initial or initial_program(worker.job, worker.state_shardings, worker.mesh))()
        return Restoration(state, 0, local_copy(state), Tier.NONE, 0, None), 0.0
    # Only the source slice's shards are read: the other slices' would be thrown away. A process of it
    # whose shards are in its neighbour's RAM takes them from there.
    in_source = worker.process_id // worker.slice_size == restore.source
    takes = in_source and worker.process_id % worker.slice_size in restore.from_neighbour
    tier: Tier = Tier.NONE
    mine = None
    started = time.monotonic()
    if takes:
        tier = Tier.NEIGHBOUR
    elif in_source:
        tier, mine = read_own(worker, restore, files)
    read_s = time.monotonic() - started
    if abandoned.is_set():  # the group re-formed while this read: the backend is no longer this group's
        raise RuntimeError(f"the restore of step {restore.step} was abandoned")
    # The source slice's readers may take long (the durable tier); the others wait for them here, not in the
    # collective below, which gloo's collective timeout would end.
    meet(f"restore/{restore.generation}/{restore.step}", _READ_TIMEOUT_S, abandoned)
    spare = worker.neighbour if worker.neighbour is not None and worker.neighbour.step == restore.step else None
    assert worker.restorer is not None
    # Every member takes its shards from the source slice, its own included: every member then holds
    # exactly the source's values, whichever tier each one held.
    started = time.monotonic()
    state, position = worker.restorer(
        mine.tree if mine is not None else None,
        mine.data_position if mine is not None else 0,
        source=restore.source,
        neighbour=spare.tree if spare is not None else None,
        neighbour_position=spare.data_position if spare is not None else -1,
        from_neighbour=bool(restore.from_neighbour),
    )
    jax.block_until_ready(state)
    transfer_s = time.monotonic() - started
    if mine is not None:
        boxes, nbytes = mine.tree, mine.nbytes
    else:  # what came from the neighbour's copy counts as delivered by it; a non-source member's, as nothing
        boxes = local_copy(state)
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(boxes)) if takes else 0
    return Restoration(state, position, boxes, tier, nbytes, spare, read_s, transfer_s), 0.0


def adopt_restored(worker: WorkerState, restore: RestoreStep, done: Restoration) -> None:
    """The group's restore finished: the worker holds its step (and the neighbour copy of it it kept)."""
    worker.neighbour = done.neighbour
    # Its StateRestored is dropped: the controller publishes the group's, timed there.
    worker.core.restored(done.state, restore.step, data_position=done.position, restored_from=done.tier, seconds=0.0)
    worker.ram = replica(
        restore.step, done.position, done.boxes, worker.identity | worker.layout, generation=restore.generation
    )
    restored = Restored(
        worker=worker.worker,
        generation=restore.generation,
        step=restore.step,
        tier=done.tier,
        nbytes=done.nbytes,
        read_s=done.read_s,
        transfer_s=done.transfer_s,
    )
    worker.link.send(restored)
    worker.heartbeat()


def read_own(worker: WorkerState, restore: RestoreStep, files: dict[int, list[DiskTier]]) -> tuple[Tier, HostSnapshot]:
    """This process's shards of the step, from the fastest tier holding them that verifies (the core's restore
    routine over its RAM replica, its replica files, the durable tier). Each one that fails its checksums is
    reported (``CheckpointCorrupt``); when all fail, CheckpointInvalid is raised, and the controller re-forms from
    another step: never a partial state."""
    step = restore.step
    if worker.ram is not None and worker.ram.step == step:
        return Tier.RAM, worker.ram
    failures: list[tuple[Tier, CheckpointInvalid]] = []
    listeners: list[CorruptionListener] = [lambda name, _step, exc: failures.append((Tier(name), exc))]
    sources: list[_Holder] = []
    if step in files:
        from_files = lambda: worker.replicas.read(step, files[step], worker.local_like)  # noqa: E731
        sources.append(_Holder(worker.files_tier, step, from_files, listeners))
    if step in worker.durable_steps:
        sources.append(_Holder(Tier.DURABLE, step, lambda: read_durable(worker, step), listeners))
    try:
        holder, snapshot = core_restore.restore_step(sources, step, timeout=_READ_TIMEOUT_S)
    except (CheckpointInvalid, SnapshotUnavailable) as exc:
        if not failures:  # the plan counted on this process, which said it holds the step
            where = str(worker.replicas.directory)
            why = "not held" if not sources else str(exc)
            failures.append((Tier.NONE, CheckpointInvalid(f"step {step}: {why}", path=where, reason=why)))
        report_unreadable(worker, restore, failures, recovered_from=None)
        raise failures[-1][1] from exc
    assert isinstance(holder, _Holder)
    report_unreadable(worker, restore, failures, recovered_from=holder.tier)
    return holder.tier, snapshot


@dataclass
class _Holder:
    """A tier holding this process's shards of ``step``, as the core's restore routine reads a source
    (``elastic_runtime.core.restore.RestoreSource``)."""

    tier: Tier
    step: int
    read: Callable[[], HostSnapshot]
    corruption_listeners: list[CorruptionListener]
    name: str = field(init=False)  # the tier's name, as the routine reports a failure

    def __post_init__(self) -> None:
        self.name = str(self.tier)

    def steps(self, *, timeout: float) -> list[int]:
        return [self.step]

    def restore(self, step: int, like: PyTree = None, *, timeout: float) -> HostSnapshot:
        return self.read()


def report_unreadable(
    worker: WorkerState,
    restore: RestoreStep,
    failures: list[tuple[Tier, CheckpointInvalid]],
    *,
    recovered_from: Tier | None,
) -> None:
    for tier, exc in failures:
        log.error("step %d unreadable from %s: %s", restore.step, tier, exc)
        corrupt = CheckpointCorrupt(
            step=restore.step,
            source="worker",
            tier=tier,
            path=exc.path,
            reason=exc.reason,
            error_type=type(exc).__name__,
            message=str(exc),
        )
        report = EventReport(
            worker=worker.worker, generation=restore.generation, event=corrupt, recovered_from=recovered_from
        )
        worker.link.send(report)


def read_durable(worker: WorkerState, step: int) -> HostSnapshot:
    """This process's shards of durable checkpoint ``step``, only the bytes they need, verified."""
    assert worker.durable is not None
    manifest = worker.durable.manifest(step)
    boxes, nbytes = worker.durable.read(
        step, manifest, worker.template, worker.state_shardings, process=worker.process_id
    )
    snapshot = replica(step, manifest.data_position, boxes)
    snapshot.nbytes = nbytes
    return snapshot


@dataclass
class Restoration:
    """What a restore gives a worker: the state on its devices, its data position, this process's boxes of it,
    and where they came from."""

    state: PyTree
    position: int
    boxes: PyTree
    tier: Tier
    nbytes: int
    neighbour: HostSnapshot | None  # the neighbour copy of the restored step it keeps, if any
    read_s: float = 0.0  # its read of its own shards from ``tier``
    transfer_s: float = 0.0  # its part in the group's collective
