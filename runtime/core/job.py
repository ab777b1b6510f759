"""What the user hands the runtime: an initial state, a step function, a data source, and shardings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from jax.sharding import PartitionSpec

PyTree = Any
StepFn = Callable[[PyTree, PyTree], tuple[PyTree, dict[str, Any]]]


class DataSource(Protocol):
    """A deterministic source of global batches: the same position always gives the same batch.

    The position is part of the training state, so after a restore no batch is skipped or seen twice.
    """

    def batch(self, position: int) -> PyTree:
        """The global batch at ``position`` as host (numpy) arrays."""
        ...


@dataclass(frozen=True)
class TrainJob:
    """A training job the runtime can run, re-mesh and restore.

    Args:
        init: returns the initial state (a pytree of arrays). Called once, on the host.
        step: ``step(state, batch) -> (new_state, metrics)``, a pure function; the runtime jits it per mesh.
        data: the data source; ``data.batch(position)`` is the global batch.
        state_specs: PartitionSpecs for the state, as a pytree prefix (one ``P()`` replicates everything).
        batch_spec: PartitionSpec(s) for the batch, as a pytree prefix; by default split over ``data``.
        loss_key: the metric reported as the loss in events and progress.
    """

    init: Callable[[], PyTree]
    step: StepFn
    data: DataSource
    state_specs: PyTree = field(default_factory=PartitionSpec)
    batch_spec: PyTree = field(default_factory=lambda: PartitionSpec("data"))
    loss_key: str = "loss"
