"""What the user hands the runtime: an initial state, a step function, a data source, and shardings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from jax.sharding import Mesh, PartitionSpec

from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.mesh import ProcessMesh

PyTree = Any
StepFn = Callable[[PyTree, PyTree], tuple[PyTree, dict[str, Any]]]


class DataSource(Protocol):
    """A deterministic source of global batches: the same position always gives the same batch.

    The position is part of the training state, so after a restore no batch is skipped or seen twice.
    """

    def batch(self, position: int) -> PyTree:
        """The global batch at ``position`` as host (numpy) arrays."""
        ...


@runtime_checkable
class ProcessBatches(Protocol):
    """A data source that can give a process only its rows of a global batch (under ``launch``, each worker
    reads its share of every batch instead of all of it: :mod:`elastic_runtime.core.process_data`). Every leaf of a
    batch has the batch's rows as its first axis.
    """

    global_batch: int  # rows in a global batch

    def batch(self, position: int) -> PyTree:
        """The global batch at ``position`` as host (numpy) arrays (what a single process reads)."""
        ...

    def rows(self, position: int, start: int, stop: int) -> PyTree:
        """Rows ``start`` to ``stop - 1`` of the global batch at ``position``, as host (numpy) arrays: exactly
        those rows of ``batch(position)``."""
        ...


@dataclass(frozen=True)
class TrainJob:
    """A training job the runtime can run, re-mesh and restore.

    Every trace of the step (the first, a background compile for a likely mesh, a worker's) runs under
    ``jax.set_mesh(mesh)``: inside it ``jax.sharding.get_abstract_mesh()`` is the mesh's and a bare
    PartitionSpec in ``with_sharding_constraint`` refers to it. A ``Mesh`` or ``Device`` object outlives
    neither a re-mesh nor, under ``launch``, a re-forming of the group (a new backend, new devices): a model
    that keeps its concrete mesh must be built per mesh, with ``step_for_mesh``.

    Args:
        init: returns the initial state (a pytree of arrays). Traced, never run on the host: its shapes come from
            ``jax.eval_shape``, its values from ``init`` compiled with ``state_specs`` as ``out_shardings``, each
            process computing only its shards. One returning host (NumPy) arrays is called on every process
            instead, each holding the whole state while it starts (:mod:`elastic_runtime.core.initial`).
        step: ``step(state, batch) -> (new_state, metrics)``, a pure function; the runtime jits it per mesh.
        data: the data source; ``data.batch(position)`` is the global batch; a :class:`ProcessBatches` source
            gives each process of a launched group only its rows of it.
        state_specs: PartitionSpecs for the state, as a pytree prefix (one ``P()`` replicates everything).
        batch_spec: PartitionSpec(s) for the batch, as a pytree prefix; by default split over ``data``.
        loss_key: the metric reported as the loss in events and progress; a tuple of keys names one in
            nested metrics (MaxText's ``("scalar", "learning/loss")``).
        step_for_mesh: builds the step for a mesh (called once per mesh, before it is traced), for a model
            that keeps the concrete ``Mesh`` it runs on; ``step`` may then be None.
        process_mesh: the mesh of a multi-process group (``elastic-runtime launch``): its axis names and the
            sizes of the axes inside a slice; see :class:`~elastic_runtime.core.mesh.ProcessMesh`.

    Raises:
        ConfigError: neither ``step`` nor ``step_for_mesh`` is given.
    """

    init: Callable[[], PyTree]
    step: StepFn | None
    data: DataSource
    state_specs: PyTree = field(default_factory=PartitionSpec)
    batch_spec: PyTree = field(default_factory=lambda: PartitionSpec("data"))
    loss_key: str | tuple[str, ...] = "loss"
    step_for_mesh: Callable[[Mesh], StepFn] | None = None
    process_mesh: ProcessMesh = field(default_factory=ProcessMesh)

    def __post_init__(self) -> None:
        if self.step is None and self.step_for_mesh is None:
            raise ConfigError("TrainJob needs a step: give step, or step_for_mesh")

    def step_on(self, mesh: Mesh) -> StepFn:
        """The step to trace for ``mesh``."""
        if self.step_for_mesh is not None:
            return self.step_for_mesh(mesh)
        assert self.step is not None
        return self.step

    @property
    def loss_path(self) -> tuple[str, ...]:
        """The keys of the loss in the step's metrics, outermost first."""
        return (self.loss_key,) if isinstance(self.loss_key, str) else tuple(self.loss_key)

    def loss(self, metrics: Any) -> Any:
        """The loss in ``metrics`` (``loss_key``), or None where it is not."""
        for key in self.loss_path:
            if not isinstance(metrics, dict) or key not in metrics:
                return None
            metrics = metrics[key]
        return metrics
