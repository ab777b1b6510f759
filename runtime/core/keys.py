"""Typed PRNG keys in the state, stored as their key data.

A state may hold typed key arrays (``jax.random.key``: MaxText's does). Host copies, replica files, Orbax and
the collectives that move shards between processes take arrays of numeric dtypes only, so the runtime keeps
every key leaf as its key data (``jax.random.key_data``: ``uint32``, one trailing axis more) and wraps it back
(``jax.random.wrap_key_data``, the implementation the leaf had) wherever the user's code sees the state: inside
the traced step, in a handler's ``transform_state`` and in the run's result. Both conversions are free inside
``jit``. A job without key leaves is used as it is.

The key data's extra trailing axis is never split: a leaf's PartitionSpec is shorter than its rank there, and
a spec shorter than an array's rank leaves the other axes whole, so the user's ``state_specs`` apply unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from elastic_runtime.core.job import PyTree, StepFn, TrainJob

__all__ = ["KeyLeaves", "with_key_data"]


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


class KeyLeaves:
    """Which leaves of a state are typed keys, with their implementations (None for other leaves)."""

    def __init__(self, impls: list[Any]) -> None:
        self.impls = impls

    @classmethod
    def of(cls, init: Callable[[], PyTree]) -> KeyLeaves:
        """The key leaves of the state ``init`` returns, found by tracing it (nothing is computed)."""
        impls: list[Any] = []

        def traced() -> PyTree:
            state = init()
            impls.extend(jax.random.key_impl(x) if _is_key(x) else None for x in jax.tree.leaves(state))
            return state

        jax.eval_shape(traced)
        return cls(impls)

    def __bool__(self) -> bool:
        return any(impl is not None for impl in self.impls)

    def to_data(self, state: PyTree) -> PyTree:
        """``state`` with each key leaf replaced by its key data."""
        leaves, treedef = jax.tree.flatten(state)
        return jax.tree.unflatten(treedef, [jax.random.key_data(x) if _is_key(x) else x for x in leaves])

    def to_keys(self, state: PyTree) -> PyTree:
        """``state`` (as :meth:`to_data` returns it, on devices or in host memory) with its key leaves wrapped
        again."""
        leaves, treedef = jax.tree.flatten(state)
        wrapped = [
            x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(leaves, self.impls, strict=True)
        ]
        return jax.tree.unflatten(treedef, wrapped)


def with_key_data(job: TrainJob) -> tuple[TrainJob, KeyLeaves]:
    """``job`` as the runtime runs it: its state's key leaves as key data (the same job when there are none),
    and the :class:`KeyLeaves` that turn a state of it back into the user's."""
    keys = KeyLeaves.of(job.init)
    if not keys:
        return job, keys

    def wrap(step: StepFn) -> StepFn:
        def step_on_key_data(state: PyTree, batch: PyTree) -> tuple[PyTree, Any]:
            new_state, metrics = step(keys.to_keys(state), batch)
            return keys.to_data(new_state), metrics

        return step_on_key_data

    user_init, for_mesh = job.init, job.step_for_mesh
    stored = dataclasses.replace(
        job,
        init=lambda: keys.to_data(user_init()),
        step=wrap(job.step) if job.step is not None else None,
        step_for_mesh=(lambda mesh: wrap(for_mesh(mesh))) if for_mesh is not None else None,
    )
    return stored, keys
