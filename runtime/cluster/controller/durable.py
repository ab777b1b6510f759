"""The controller's half of the group's durable checkpoints: collect every writer's part, commit when whole.

The workers of the first slice each write their own shards of a step (``storage/sharded.py``) and report the
files in a ``Saved`` message. A step is committed (its manifest written) once every process of that slice
reported it from the current generation: a part from an older generation, whose group was re-formed while it
wrote, is dropped, so a write of a fenced group never becomes a committed checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from elastic_runtime.cluster.protocol import Saved
from elastic_runtime.core.errors import StorageError
from elastic_runtime.core.events import CheckpointCommitted
from elastic_runtime.storage import sharded
from elastic_runtime.storage.manifest import FileEntry, LeafEntry, check_relative
from elastic_runtime.storage.sharded import ShardedStore

__all__ = ["DurableCommits"]

log = logging.getLogger(__name__)


@dataclass
class _Step:
    parts: dict[int, tuple[FileEntry, ...]] = field(default_factory=dict)  # process id -> its files
    data_position: int = 0
    structure: str = ""
    leaves: tuple[LeafEntry, ...] = ()
    metadata: dict[str, str] = field(default_factory=dict)


class DurableCommits:
    """Parts of durable checkpoints in flight, per step, for the current generation only.

    Args:
        location: the durable checkpoints' folder or ``gs://`` URI
        (:class:`~elastic_runtime.storage.sharded.ShardedStore`). writers: processes that write a part of every step
        (the first slice). keep: committed checkpoints kept; older ones are deleted after each commit.
        metadata: what every manifest carries whatever the writers say (the run's id).
    """

    def __init__(self, location: str, *, writers: int, keep: int, metadata: dict[str, str]) -> None:
        self.store = ShardedStore(location)
        self.writers = writers
        self.keep = keep
        self.metadata = metadata
        self.generation = 0
        self._steps: dict[int, _Step] = {}

    def new_generation(self, generation: int) -> None:
        """Drop every part in flight: the old group's writes are never committed."""
        self.generation = generation
        self._steps.clear()

    def add(self, saved: Saved, process_id: int) -> int | None:
        """Take one writer's part; returns its step when that step is now whole (call :meth:`commit`).

        Raises:
            CheckpointInvalid: a file path outside the step's folder (the part is dropped).
        """
        if saved.generation != self.generation or not 0 <= process_id < self.writers:
            log.info("durable part of step %d from generation %d dropped", saved.step, saved.generation)
            return None
        for entry in saved.files:
            check_relative(entry.path, where=f"worker {saved.worker}'s part of step {saved.step}")
        step = self._steps.setdefault(saved.step, _Step())
        step.parts[process_id] = saved.files
        step.data_position = saved.data_position
        if saved.leaves:
            # The run's id is the controller's to say, whatever a worker claims.
            step.structure, step.leaves = saved.structure, saved.leaves
            step.metadata = saved.metadata | self.metadata | {"generation": str(self.generation)}
        return saved.step if len(step.parts) == self.writers and step.leaves else None

    def withdraw(self, step: int) -> None:
        """Make committed ``step`` invisible: a damaged checkpoint is not offered again (blocking)."""
        self.store.withdraw(step)

    def commit(self, step: int) -> CheckpointCommitted:
        """Write ``step``'s manifest (blocking: run it in a thread), then delete the checkpoints past ``keep``;
        the event that says so, for the controller to publish.

        Raises:
            StorageError: the manifest could not be written; the step stays uncommitted.
        """
        started = time.monotonic()
        parts = self._steps.pop(step)
        files = [entry for files in parts.parts.values() for entry in files]
        manifest = sharded.manifest_of(
            step=step,
            data_position=parts.data_position,
            structure=parts.structure,
            leaves=parts.leaves,
            files=files,
            metadata=parts.metadata,
        )
        try:
            self.store.commit(manifest)
        except OSError as exc:
            raise StorageError(f"durable: committing step {step} at {self.store.where(step)} failed: {exc}") from exc
        self.store.prune(self.keep, self.metadata["run_id"])
        for older in [s for s in self._steps if s < step]:
            del self._steps[older]  # never to be whole: a writer skipped it
        return CheckpointCommitted(
            step=step,
            source="controller",
            tier="durable",
            path=self.store.where(step),
            bytes=sum(f.size for f in files),
            seconds=time.monotonic() - started,
        )
