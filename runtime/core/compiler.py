"""Compiled steps per mesh, ahead of time where recovery is likely; one compile per mesh shape on CPU, the other
meshes of that shape loading it (``elastic_runtime.core.same_shape``).

A recovery onto a mesh whose step is already compiled does not wait for XLA. The runtime asks for the
likely degraded meshes in the background (see ``MeshPolicy.likely_meshes``); a request for a mesh whose
compile is under way waits for that compile instead of starting a second one.

With ``host_copy`` the compiled step takes a third argument and returns a third output: host-memory arrays
of the state's layout (``host_shardings``), donated, and the new state written into them (see
``elastic_runtime.core.snapshot``). The RAM snapshot of every step is then made by XLA inside the step, into the buffers
of a snapshot that is no longer needed (or fresh ones, ``fresh_buffers``), so no new host memory is taken.

With ``into_spare`` the compiled step takes a third argument of the state's own layout, donated, and writes the new
state into it: a state no one holds any more (the multi-process worker's, ``elastic_runtime.cluster.worker.spares``), so
that a step takes no fresh memory. The state it reads is not donated: a step that fails leaves it whole.

With ``fingerprint`` (a replica axis) the compiled step returns, after its metrics, every device's digest of the new
state's leaves replicated over that axis, gathered onto every device where the mesh spans processes
(``elastic_runtime.core.fingerprint.read_digests``): the replicas are compared without a program of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic_runtime.core.fingerprint import device_digests, digests_sharding, replicated_leaves
from elastic_runtime.core.job import PyTree, TrainJob
from elastic_runtime.core.mesh import mesh_key
from elastic_runtime.core.programs import ProgramStore, compile_kept
from elastic_runtime.core.same_shape import SameShape
from elastic_runtime.core.snapshot import host_shardings


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def shardings_for(specs: PyTree, mesh: Mesh) -> PyTree:
    """Map a pytree (prefix) of PartitionSpecs to NamedShardings on ``mesh``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)


def abstract(tree: PyTree) -> PyTree:
    """Shapes and dtypes of ``tree``'s leaves. A leaf's own dtype where it has one: a typed PRNG key array
    (``jax.random.key``) has no NumPy dtype to convert to."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", None) or np.asarray(x).dtype), tree
    )


class StepCompiler:
    """Holds the user's step compiled for each mesh it ran or may run on. Thread-safe."""

    def __init__(
        self,
        job: TrainJob,
        state_example: PyTree,
        batch_example: PyTree,
        *,
        host_copy: bool = False,
        into_spare: bool = False,
        fingerprint: str | None = None,
        programs: ProgramStore | None = None,
        place: Hashable = (),
    ) -> None:
        self.job = job
        if host_copy and into_spare:
            raise ValueError("a step writes into host buffers (host_copy) or a spare state (into_spare), not both")
        if host_copy and fingerprint:
            raise ValueError("a step with a fused host copy (host_copy) returns no fingerprint")
        self.host_copy = host_copy
        self.into_spare = into_spare
        self.fingerprint = fingerprint
        # Where compiled programs are kept to be loaded on a new backend (elastic_runtime.core.programs), keyed by the
        # mesh and ``place`` (under launch: this process's place in the group); None: compiled each time.
        self.programs = programs
        self.place = place
        # Without kept programs (one process, where meshes of one shape are compiled ahead one per slice): the
        # first mesh of a shape is compiled, the others load its executable onto their devices.
        self.same_shape = SameShape()
        self._state_abstract = abstract(state_example)
        self._batch_abstract = abstract(batch_example)
        self._lock = threading.Lock()
        self._compiled: dict[Any, Future[Any]] = {}
        self._batch_shardings: dict[Any, PyTree] = {}
        self._host_shardings: dict[Any, PyTree] = {}
        self._fresh_buffers: dict[Any, Any] = {}

    def state_shardings(self, mesh: Mesh) -> PyTree:
        return shardings_for(self.job.state_specs, mesh)

    def host_shardings(self, mesh: Mesh) -> PyTree:
        """The layout of the state's copy in host memory on ``mesh``
        (``elastic_runtime.core.snapshot.host_shardings``)."""
        key = mesh_key(mesh)
        shardings = self._host_shardings.get(key)
        if shardings is None:  # built once per mesh: this runs on every step
            state = self.state_shardings(mesh)
            shardings = self._host_shardings[key] = host_shardings(state, self._state_abstract)
        return shardings

    def fresh_buffers(self, mesh: Mesh) -> PyTree:
        """Fresh arrays for the step's third argument to be written into (``host_copy``: host memory for the fused
        copy; ``into_spare``: the new state), when no spare one is at hand (their maker is compiled with the step
        for ``mesh``, which this compiles first if need be)."""
        key = mesh_key(mesh)
        if key not in self._fresh_buffers:
            self.get(mesh)
        return self._fresh_buffers[key]()

    def state_abstract(self, mesh: Mesh) -> PyTree:
        """The state's shapes and dtypes with its shardings on ``mesh``: enough to compile for its layout. One sharding
        a leaf, where the job's specs are a prefix of the state (one ``P()`` for all of it, the default)."""
        shardings = jax.tree.broadcast(self.state_shardings(mesh), self._state_abstract)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self._state_abstract, shardings
        )

    def batch_shardings(self, mesh: Mesh) -> PyTree:
        key = mesh_key(mesh)
        shardings = self._batch_shardings.get(key)
        if shardings is None:  # built once per mesh: this runs on every step
            shardings = self._batch_shardings[key] = shardings_for(self.job.batch_spec, mesh)
        return shardings

    def loaded(self, mesh: Mesh) -> int:
        """How many of ``mesh``'s programs were loaded from another mesh's compile instead of compiled."""
        return self.same_shape.loaded.get(mesh_key(mesh)[2], 0)

    def is_ready(self, mesh: Mesh) -> bool:
        with self._lock:
            future = self._compiled.get(mesh_key(mesh))
        return future is not None and future.done()

    def get(self, mesh: Mesh) -> Any:
        """The step compiled for ``mesh``; compiles it (blocking) unless done or under way."""
        key = mesh_key(mesh)
        with self._lock:
            future = self._compiled.get(key)
            owner = future is None
            if owner:
                future = self._compiled[key] = Future()
        assert future is not None
        if owner:
            try:
                future.set_result(self._compile(mesh))
            except BaseException as exc:
                future.set_exception(exc)
                with self._lock:
                    del self._compiled[key]  # a later request may try again
        return future.result()

    def _compile(self, mesh: Mesh) -> Any:
        # Traced under its mesh, as a real model expects: a bare PartitionSpec in with_sharding_constraint, or a
        # module that asks for the mesh it runs on (jax.sharding.get_abstract_mesh), finds this one. The context
        # is the compiling thread's own, so background compiles for other meshes do not see it.
        with jax.set_mesh(mesh):
            return self._compile_traced(mesh)

    def _compile_traced(self, mesh: Mesh) -> Any:
        try:
            return self._compile_on(mesh)
        except Exception as exc:
            if not self.host_copy:
                raise
            # An error in the user's step or specs surfaces through the fused copy's pinned_host shardings,
            # which the user never wrote: compile the step alone, and report its own error if it has one.
            try:
                self._plain(mesh).lower(self._state_abstract, self._batch_abstract).compile()
            except Exception as plain:
                raise plain from exc
            raise

    def _plain(self, mesh: Mesh) -> Any:
        """The user's step, jitted with its own shardings and nothing added."""
        state_sharding = self.state_shardings(mesh)
        inputs = (state_sharding, self.batch_shardings(mesh))
        return jax.jit(
            self.job.step_on(mesh),
            in_shardings=inputs,
            out_shardings=(state_sharding, NamedSharding(mesh, PartitionSpec())),
        )

    def _compile_on(self, mesh: Mesh) -> Any:
        args: tuple[Any, ...] = (self._state_abstract, self._batch_abstract)
        if not (self.host_copy or self.into_spare or self.fingerprint):
            return self._build("step", mesh, lambda: self._plain(mesh).lower(*args))
        state_sharding = self.state_shardings(mesh)
        inputs: tuple[Any, ...] = (state_sharding, self.batch_shardings(mesh))
        outputs: tuple[Any, ...] = (state_sharding, NamedSharding(mesh, PartitionSpec()))
        step, name = self.job.step_on(mesh), "step"
        if self.fingerprint is not None:
            leaves = jax.tree.leaves(self.state_abstract(mesh))
            chosen = replicated_leaves(leaves, self.fingerprint)
            specs = [leaves[i].sharding.spec for i in chosen]
            step, name = _with_digests(step, chosen, device_digests(mesh, specs)), "step+digests"
            outputs += (digests_sharding(mesh),)
        if not (self.host_copy or self.into_spare):
            jitted = jax.jit(step, in_shardings=inputs, out_shardings=outputs)
            return self._build(name, mesh, lambda: jitted.lower(*args))
        if self.host_copy:
            buffers = self.host_shardings(mesh)
            step = _with_host_copy(step, state_sharding)
            outputs += (buffers,)
        else:
            buffers = state_sharding
            step = _into_spare(step)
        # keep_unused: jit would otherwise drop an unread buffers argument, and its donation with it.
        jitted = jax.jit(
            step, in_shardings=(*inputs, buffers), out_shardings=outputs, donate_argnums=2, keep_unused=True
        )
        args += (self._state_abstract,)

        def zeros() -> PyTree:
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), self._state_abstract)

        # Compiled now, with the step: on a new mesh its first step needs fresh buffers, and a compile there
        # would hold up the first step after a recovery.
        maker = jax.jit(zeros, out_shardings=buffers)
        what = "host buffers" if self.host_copy else "spare state"
        self._fresh_buffers[mesh_key(mesh)] = self._build(what, mesh, maker.lower)
        return self._build(name, mesh, lambda: jitted.lower(*args))

    def _build(self, name: str, mesh: Mesh, lower: Callable[[], Any]) -> Any:
        if self.programs is None:
            return self.same_shape.compiled(name, mesh, lower())
        return compile_kept(self.programs, name, mesh, self.place, lower)


def _with_host_copy(step: Any, state_sharding: PyTree) -> Any:
    """``step`` returning the new state a second time, for a host-memory output; ``buffers`` (donated, of
    the same shapes and host layout) are only there for XLA to write that output into."""

    def step_and_copy(state: PyTree, batch: PyTree, buffers: PyTree) -> tuple[PyTree, Any, PyTree]:
        del buffers
        new_state, metrics = step(state, batch)
        # Pinned, so that the host copy's layout does not propagate into how the step itself computes.
        new_state = jax.lax.with_sharding_constraint(new_state, state_sharding)
        return new_state, metrics, new_state

    return step_and_copy


def _with_digests(step: Any, chosen: list[int], digests: Any) -> Any:
    """``step`` returning every device's digest of the new state's ``chosen`` leaves as one more output, computed
    (and, across processes, gathered) in the step's own program: comparing the replicas adds no program, no
    dispatch and no wait of its own to a step (``elastic_runtime.core.fingerprint``)."""

    def step_and_digests(state: PyTree, batch: PyTree) -> tuple[PyTree, Any, Any]:
        new_state, metrics = step(state, batch)
        leaves = jax.tree.leaves(new_state)
        return new_state, metrics, digests(*(leaves[i] for i in chosen))

    return step_and_digests


def _into_spare(step: Any) -> Any:
    """``step`` with a third argument, ``spare``, of the state's shapes and layout, donated, for XLA to write the new
    state into (jit pairs a donated input with an output of its shape and layout)."""

    def step_into(state: PyTree, batch: PyTree, spare: PyTree) -> tuple[PyTree, Any]:
        del spare
        return step(state, batch)

    return step_into
