"""The step both training loops run: the state as a step reads it, its program queued, its results checked and
read, its commit, and a restore's place in the books.

The single-process executor (:mod:`elastic_runtime.core.executor`, one step in flight behind the one it commits)
and a worker of an ``elastic-runtime launch`` group (:mod:`elastic_runtime.cluster.worker.training`, one step at a
time in a thread it can abandon when a peer dies in a collective) drive the same :class:`StepCore`: what a step
reads (fault injection's input faults), what runs when its results are ready (the step checks), how its loss and
metrics are read, and in which order a commit happens (the results replace the old ones, the tiers due keep the
step, and the ledger moves on last), are decided here once. What differs by mode stays with the mode: where a
batch comes from, which extra buffers and outputs the compiled program has, which tiers keep a step, how the
slices' or replicas' copies are compared. Synchronous: it runs in the thread that owns the steps, and owns no
thread, loop or clock of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from elastic_runtime.core.events import StateRestored
from elastic_runtime.core.job import PyTree, TrainJob
from elastic_runtime.core.keys import KeyLeaves
from elastic_runtime.core.ledger import CommitNoted, StepLedger
from elastic_runtime.core.metrics import scalar_metrics

__all__ = ["InputFault", "StepCheck", "StepCore"]

# Called with (step, the ids of the devices it ran on) once its results are ready, before it is committed; one that
# raises fails the step as that exception (a site's result validation, or a fault injector).
StepCheck = Callable[[int, tuple[int, ...]], None]
# Maps (step, the state the step is about to read) to the state it reads instead: fault injection's way to make a
# device compute wrong (elastic_runtime.testing.faults, elastic_runtime.faults.process).
InputFault = Callable[[int, PyTree], PyTree]


class StepCore:
    """One training loop's committed state and the step that moves it on.

    Args:
        job: the job as it runs (typed PRNG keys held as key data: :mod:`elastic_runtime.core.keys`).
        keys: the key leaves of its state, turned back into typed keys wherever the user's code sees the state.
        ledger: the loop's books (committed step, data position, tiers due, recovery).
    """

    def __init__(self, job: TrainJob, keys: KeyLeaves, ledger: StepLedger) -> None:
        self.job = job
        self.keys = keys
        self.ledger = ledger
        self.step_checks: list[StepCheck] = []
        self.input_faults: list[InputFault] = []
        self.state: PyTree = None  # the newest committed step's, or the one restored or placed to start from
        self.loss: float | None = None  # of the newest committed step
        self.metrics: dict[str, float] = {}  # every scalar metric of the newest committed step
        self.step_s: float | None = None  # the newest committed step's computation
        self.mesh_shape: dict[str, int] = {}  # the newest committed step's mesh, where the loop names it
        self.productive_s = 0.0  # the committed steps' computation, in all (progress lines: goodput so far)
        self._loss_name = "/".join(job.loss_path)  # the name scalar_metrics gives the loss (keys joined with "/")

    @property
    def step(self) -> int:
        """The newest committed step."""
        return self.ledger.step

    @property
    def data_position(self) -> int:
        """Where the data of the step after it starts."""
        return self.ledger.data_position

    def launch(self, program: Callable[..., Any], state: PyTree, step: int, batch: PyTree, *extra: Any) -> Any:
        """Queue step ``step`` on the devices: ``program(state, batch, *extra)``, the state as the step reads it (the
        input faults applied). Returns what the program returns, without waiting for it."""
        for fault in self.input_faults:
            state = fault(step, state)
        return program(state, batch, *extra)

    def results(
        self, step: int, new_state: PyTree, metrics: Any, devices: tuple[int, ...]
    ) -> tuple[float, float | None, dict[str, float]]:
        """Wait for step ``step``'s new state; then run the step checks and read its loss and every scalar metric
        (ValueError naming a metric that is not one number). Returns when the state was ready (``perf_counter``:
        what follows, a slow check included, is not the step's computation), the loss and the metrics."""
        jax.block_until_ready(new_state)
        ready = time.perf_counter()
        for check in self.step_checks:
            check(step, devices)
        scalars = scalar_metrics(metrics)
        # The loss is one of the scalars, read with them in one transfer (read again on its own, it cost another).
        loss = scalars.get(self._loss_name) if self.job.loss(metrics) is not None else None
        return ready, loss, scalars

    def commit(
        self,
        step: int,
        state: PyTree,
        *,
        loss: float | None,
        metrics: dict[str, float],
        seconds: float,
        data_position: int,
        mesh_shape: dict[str, int] | None = None,
        keep: Callable[[tuple[str, ...]], None] | None = None,
    ) -> CommitNoted:
        """Step ``step`` is committed: its results replace the old ones, ``keep`` keeps it in the tiers due at it
        (given their names: the mode's snapshots, replica files), and the ledger moves on, last, so that whoever
        reads the committed step finds its copies in place. ``data_position``: where the next step's data starts."""
        self.state, self.loss, self.metrics, self.step_s = state, loss, metrics, seconds
        self.mesh_shape = mesh_shape or self.mesh_shape
        self.productive_s += seconds
        if keep is not None:
            keep(self.ledger.due(step))
        return self.ledger.commit(step, data_position=data_position, mesh_shape=mesh_shape)

    def transform(self, fn: Callable[[PyTree], PyTree], state: PyTree, shardings: Any) -> PyTree:
        """``state`` as ``fn`` makes it (a handler's ``ctx.transform_state``), placed with ``shardings``, waited for;
        the caller replaces the committed state with it, at its step boundary. ``fn`` sees the
        state as the user's step does (typed keys as keys) and is traced with ``jax.jit`` in every mode, so that a
        script's transform means the same in one process and in a group, where it runs on every process's shards.
        Raises ValueError when it changes the state's structure, shapes or dtypes, and whatever ``fn`` raises."""
        keys = self.keys

        def on_key_data(state: PyTree) -> PyTree:
            return keys.to_data(fn(keys.to_keys(state)))

        before = jax.eval_shape(lambda tree: tree, state)
        after = jax.eval_shape(on_key_data, state)
        shapes = [[(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(tree)] for tree in (before, after)]
        if str(jax.tree.structure(before)) != str(jax.tree.structure(after)) or shapes[0] != shapes[1]:
            raise ValueError("the transform changed the state's structure, shapes or dtypes")
        return jax.block_until_ready(jax.jit(on_key_data, out_shardings=shardings)(state))

    def restored(
        self, state: PyTree, step: int, *, data_position: int, restored_from: str, seconds: float
    ) -> StateRestored:
        """``state`` of step ``step`` is in place, from ``restored_from``: the loop goes on from there (the
        ledger's :meth:`~elastic_runtime.core.ledger.StepLedger.restored`). Returns the event that says so."""
        self.state = state
        return self.ledger.restored(step, data_position=data_position, restored_from=restored_from, seconds=seconds)
