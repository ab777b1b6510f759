"""The initial state without a host copy of it: its shapes from ``jax.eval_shape``, its values made under ``jit``
with the state's shardings as ``out_shardings``, so that each process materializes only its own shards.

An ``init`` written with JAX operations (``jnp.zeros``, ``jax.random``) then never exists whole on any host: a
state larger than one host's memory can start. An ``init`` that returns host (NumPy) arrays, computing nothing
with JAX, is not compiled (its arrays would become constants of the program, as large as the state): each
process calls it and copies its own shards to its devices, so it holds the whole state in host memory while it
starts (the formula in docs/multiprocess.md). One that mixes both is compiled, its host arrays as constants.
Random values under ``jit`` do not depend on the sharding with ``jax_threefry_partitionable`` (JAX's default).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from elastic_runtime.core.job import PyTree, TrainJob
from elastic_runtime.core.programs import ProgramStore, compile_kept

__all__ = ["abstract_state", "initial_program", "place_host"]


def abstract_state(job: TrainJob) -> PyTree:
    """The shapes and dtypes of ``job``'s initial state (``jax.ShapeDtypeStruct`` leaves); nothing is computed
    on any device (a host-returning ``init`` runs once, on the host, and its arrays are let go)."""
    return jax.eval_shape(job.init)


def initial_program(
    job: TrainJob, shardings: PyTree, mesh: Mesh, *, programs: ProgramStore | None = None, place: Hashable = ()
) -> Callable[[], PyTree]:
    """What makes ``job``'s initial state on ``mesh``, laid out as ``shardings`` (a pytree prefix of the state):
    ``init`` compiled with them as ``out_shardings`` (kept in ``programs`` for ``place``, as the step is), or,
    for an ``init`` that only returns host arrays, a copy of this process's shards of them. Traced under
    ``jax.set_mesh(mesh)``, as the step is."""
    with jax.set_mesh(mesh):
        traced = jax.jit(job.init, out_shardings=shardings).trace()
        if not traced.jaxpr.jaxpr.eqns:
            del traced  # it holds the host arrays: called again when the state is made, and let go after
            return lambda: place_host(job.init(), shardings)
        compiled = compile_kept(programs, "init", mesh, place, traced.lower)
    return lambda: jax.block_until_ready(compiled())


def place_host(tree: PyTree, shardings: PyTree) -> PyTree:
    """``tree``'s host arrays on devices as ``shardings`` (a pytree prefix) lay them out, each process copying
    only the shards its devices hold."""

    def one(sharding: Any, subtree: PyTree) -> PyTree:
        return jax.tree.map(
            lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x)[idx]), subtree
        )

    return jax.block_until_ready(jax.tree.map(one, shardings, tree))
