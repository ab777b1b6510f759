"""A worker's part of the group's durable checkpoints: written in the background after a durable step commits, and
the drain's final one, written before the process exits (``Stop.durable_step``).
"""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from elastic_runtime.cluster.protocol import Saved
from elastic_runtime.core.errors import CheckpointInvalid
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.manifest import describe_leaves

if TYPE_CHECKING:
    from elastic_runtime.cluster.worker.loop import Worker

__all__ = ["final_durable", "save_durable"]

log = logging.getLogger(__name__)


def save_durable(worker: Worker, *, final: bool, snapshot: HostSnapshot | None = None) -> None:
    """Write this process's part of the durable checkpoint of the step just committed (or of ``snapshot``),
    in the background; a step whose predecessor's write is still running is not written (the next due one
    is), except the ``final`` one, which waits for it."""
    assert worker.ram is not None and worker.durable is not None
    if worker.durable_write is not None and not worker.durable_write.done() and not final:
        log.info("durable checkpoint of step %d skipped: the previous write is still running", worker.step)
        return
    # Captured here: the write runs on while a re-forming group may be without a backend (see write_part).
    snapshot, generation, process = snapshot or worker.ram, worker.generation, worker.process_id
    # Its host copy made here, not in the write: the write may outlive the backend the arrays are on.
    snapshot.tree  # noqa: B018 - the first read makes the copy
    lead, worker.durable_last = worker.process_id == 0, snapshot.step
    owned, shardings, store = worker.owned, worker.state_shardings, worker.durable

    def write() -> None:
        files = store.write(
            snapshot.step, snapshot.tree, worker.template, shardings, owned=owned, lead=lead, process=process
        )
        structure, leaves = describe_leaves(worker.template) if lead else ("", ())
        saved = Saved(
            worker=worker.worker,
            generation=generation,
            step=snapshot.step,
            data_position=snapshot.data_position,
            files=tuple(files),
            structure=structure,
            leaves=leaves,
            metadata=worker.identity if lead else {},
        )
        worker.link.send(saved)

    worker.durable_write = worker.durable_pool.submit(write)
    worker.durable_write.add_done_callback(_log_failure)


def final_durable(worker: Worker, step: int) -> None:
    """The drain's durable checkpoint (``Stop.durable_step``): this process's part of ``step``, its newest
    committed step or, when a peer held one step behind, the one before from its replica file; written (and
    its ``Saved`` sent) before the process exits."""
    if worker.durable is None or worker.ram is None or worker.process_id >= worker.slice_size:
        return  # not a writer of the group's checkpoints
    if worker.durable_write is not None:
        with contextlib.suppress(Exception):  # a failure was logged by _log_failure
            worker.durable_write.result()
        if worker.durable_last == step:
            return  # written already: its Saved is out
    snapshot: HostSnapshot | None = worker.ram
    if worker.ram.step != step:
        worker.replicas.wait()
        try:
            snapshot = worker.replicas.read(step, [worker.replicas.tier], worker.local_like)
        except CheckpointInvalid as exc:
            log.error("worker %d: no replica of step %d for the final checkpoint: %s", worker.worker, step, exc)
            return
    log.info("worker %d writes its part of the final durable checkpoint of step %d", worker.worker, step)
    save_durable(worker, final=True, snapshot=snapshot)
    assert worker.durable_write is not None
    with contextlib.suppress(Exception):
        worker.durable_write.result()


def _log_failure(future: Future[None]) -> None:
    exc = future.exception()
    if exc is not None:  # a failed write leaves the previous checkpoint; the controller commits nothing new
        log.error("durable checkpoint write failed: %s: %s", type(exc).__name__, exc)
