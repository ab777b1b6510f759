"""A fingerprint of the state, computed where it lives, and the comparison of replicas that must be equal.

Silent data corruption (a processor that computes wrong, a bit flipped in memory) announces itself nowhere: the
run trains on. What gives it away is the data-parallel replicas: every leaf of the state that is not split over
the batch axis (``MeshPolicy.batch_axis``, ``data``) is held whole by each of that axis's replicas, and all of
them must be bitwise equal after every step. Each device digests its own blocks of those leaves in one small
program (``shard_map``: no host copy of the state, one number per device back), and the replicas of each block
are compared on the host.

The digest: every element's bits as unsigned 32-bit words, each times an odd weight of its position, summed
with wrap-around, leaf after leaf. A single flipped bit changes the sum (an odd weight times a power of two is
never 0 mod 2**32), and so does a value moved to another position.

The same digest over the whole state, each element weighted by its position in its whole leaf
(:func:`state_digest`, on the devices; :func:`host_digest`, the same number from host arrays), is what a durable
checkpoint records of the state it was verified with, and what a restore checks the state it read against: the
same number on any mesh, so a corruption between the verified state and the written bytes (a host copy flipped
before its files were checksummed) is found where the files' own CRC32Cs pass.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "STATE_DIGEST",
    "Divergence",
    "Fingerprinter",
    "Healed",
    "Integrity",
    "StateDiverged",
    "compare_replicas",
    "device_digests",
    "digests_sharding",
    "host_digest",
    "read_digests",
    "replicated_leaves",
    "state_digest",
]

PyTree = Any

_GOLDEN = 0x9E3779B1  # odd: a multiplier that mixes one leaf's digest into the next


class StateDiverged(Exception):
    """Raised in the step loop (never to a user): replicas of the state that must be equal are not. Becomes a
    ``SilentCorruption`` event; ``persistent``: it came back in the replay, or its devices were suspects before."""

    def __init__(self, divergence: Divergence, *, persistent: bool) -> None:
        super().__init__(divergence.describe())
        self.divergence = divergence
        self.persistent = persistent


@dataclass(frozen=True)
class Divergence:
    """Replicas that disagree after ``step``: ``suspects`` (device ids) hold a block that differs from what the
    majority of its replicas hold; ``attributed`` is False when no strict majority says which one is wrong
    (two replicas, or a tie): then every replica of the block is a suspect."""

    step: int
    suspects: tuple[int, ...]
    digests: dict[int, str]  # device id -> its digest (hex), of the blocks that disagree
    replicas: int
    attributed: bool

    def describe(self) -> str:
        how = "the majority of" if self.attributed else "no majority among"
        return (
            f"after step {self.step} the state's replicas differ: devices {list(self.suspects)} disagree with "
            f"{how} their {self.replicas} replicas (digests {self.digests})"
        )


@dataclass(frozen=True)
class Healed:
    """The replicas agree again after ``divergence``: ``persistent`` ones by evicting its suspects, transient
    ones by the replay; ``seconds`` after it was found."""

    divergence: Divergence
    persistent: bool
    seconds: float


def _words(block: jax.Array) -> jax.Array:
    """``block``'s bits as uint32 words, one per element (two, on a trailing axis, for 8-byte elements; a typed
    PRNG key's data)."""
    if jax.dtypes.issubdtype(block.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(block)
    if block.dtype == jnp.bool_:
        return block.astype(jnp.uint32)
    if block.dtype.itemsize in (4, 8):
        return lax.bitcast_convert_type(block, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[block.dtype.itemsize]
    return lax.bitcast_convert_type(block, unsigned).astype(jnp.uint32)


def _leaf_digest(block: jax.Array) -> jax.Array:
    """One device's block as a uint32: its bits, weighted by position, summed with wrap-around."""
    flat = _words(block).reshape(-1)
    weights = jnp.arange(flat.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(flat * weights, dtype=jnp.uint32)


def _global_leaf_digest(leaf: jax.Array) -> jax.Array:
    """A whole leaf's digest, each word weighted by its position in the leaf (C order): computed where each block
    lives, partial sums added across devices (no reshape: that could gather a sharded leaf onto one device)."""
    words = _words(leaf)
    position = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        position = position + lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    return jnp.sum(words * (position * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


_global_digest = jax.jit(_global_leaf_digest)


def _combine(digests: Any) -> int:
    total = 0
    for digest in digests:
        total = (total * _GOLDEN + int(digest)) % 2**32
    return total


def state_digest(state: PyTree) -> int:
    """The whole state's digest, computed on the devices that hold it (blocks until done): every element of
    every leaf once, whatever the mesh. :func:`host_digest` gives the same number for the same values."""
    # One program a leaf: one over every leaf held a uint32 copy of the whole state at once (at 256 MB of state on
    # 4 CPU devices, the peak RSS rose 262 MB during the digest; leaf by leaf, 3 MB). And one at a time: dispatched
    # together, the programs' collectives ran at once across a group's processes, and a final digest under launch
    # hung with two processes waiting for messages the other two had paired with another leaf's program.
    return _combine([int(jax.device_get(_global_digest(leaf))) for leaf in jax.tree.leaves(state)])


STATE_DIGEST = "state_digest"  # the snapshot's (and so the checkpoint manifest's) metadata key, 8 hex digits
_HOST_PIECE = 1 << 22  # words digested at a time on the host (16 MB of weights, made once)
_host_weights: np.ndarray | None = None


def host_digest(leaves: Sequence[Any]) -> int:
    """:func:`state_digest` of arrays in host memory, given in the state's leaf order (``jax.tree.leaves``). A
    piece from word ``s`` on weighs ``2 (s + i) + 1 = (2 i + 1) + 2 s``: one dot product with the same weights for
    every piece, and ``2 s`` times its sum (about 3 GB/s on one core here, 4x the weights made per piece)."""
    global _host_weights
    if _host_weights is None:
        _host_weights = np.arange(_HOST_PIECE, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    digests = []
    for leaf in leaves:
        array = np.ascontiguousarray(leaf)
        if array.dtype == np.bool_:
            words = array.astype(np.uint32).reshape(-1)
        else:
            unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[array.dtype.itemsize]
            words = array.reshape(-1).view(unsigned).astype(np.uint32, copy=False)
        total = 0
        for start in range(0, words.size, _HOST_PIECE):
            piece = words[start : start + _HOST_PIECE]
            weighted = int(np.dot(piece, _host_weights[: piece.size]))  # uint32: wraps, as on the devices
            total = (total + weighted + 2 * start * int(piece.sum(dtype=np.uint32))) % 2**32
        digests.append(total)
    return _combine(digests)


def _spec(leaf: Any) -> P:
    sharding = leaf.sharding
    assert isinstance(sharding, NamedSharding)  # only such leaves are chosen (_replicated_over)
    return sharding.spec


def _replicated_over(sharding: Any, axis: str) -> bool:
    """Whether every replica along ``axis`` holds the same block of the leaf (its spec never names ``axis``)."""
    if not isinstance(sharding, NamedSharding):
        return False
    for entry in sharding.spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis in names:
            return False
    return True


class Fingerprinter:
    """The per-device digest of the state's leaves replicated over ``replica_axis``, compiled once per layout.

    Args:
        replica_axis: the data-parallel axis whose replicas must agree.
    """

    def __init__(self, replica_axis: str) -> None:
        self.replica_axis = replica_axis
        self._programs: dict[Any, Any] = {}

    def covers(self, state: PyTree) -> bool:
        """Whether ``state`` (on a mesh) has anything to compare: a leaf replicated over 2 or more replicas."""
        return bool(self._chosen(state)[0]) and self._replicas(state) >= 2

    def _replicas(self, state: PyTree) -> int:
        leaves = jax.tree.leaves(state)
        mesh = leaves[0].sharding.mesh if leaves and isinstance(leaves[0].sharding, NamedSharding) else None
        return int(mesh.shape.get(self.replica_axis, 1)) if mesh is not None else 1

    def _chosen(self, state: PyTree) -> tuple[list[Any], Mesh | None]:
        every = jax.tree.leaves(state)
        leaves = [every[i] for i in replicated_leaves(every, self.replica_axis)]
        return leaves, (leaves[0].sharding.mesh if leaves else None)

    def digests(self, state: PyTree) -> tuple[np.ndarray, Mesh]:
        """Every device's digest, as an array shaped like the mesh's devices (blocks until computed). On a mesh
        over several processes, a collective of the group: every process calls it."""
        leaves, mesh = self._chosen(state)
        assert mesh is not None, "nothing to fingerprint: check covers() first"
        return read_digests(self._program(mesh, leaves)(*leaves), mesh), mesh

    def prepare(self, abstract: PyTree) -> None:
        """Compile the digest for the layout of ``abstract`` (ShapeDtypeStructs with their shardings) now: a
        recovery onto that mesh then compiles nothing for it (the executor's ``prepare``)."""
        leaves, mesh = self._chosen(abstract)
        if mesh is not None and mesh.shape.get(self.replica_axis, 1) >= 2:
            self._program(mesh, leaves)

    def _program(self, mesh: Mesh, leaves: list[Any]) -> Any:
        layout = tuple((x.shape, x.dtype, _spec(x)) for x in leaves)
        key = (tuple(d.id for d in mesh.devices.flat), mesh.axis_names, layout)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._compile(mesh, leaves)
        return program

    def _compile(self, mesh: Mesh, leaves: list[Any]) -> Any:
        return jax.jit(device_digests(mesh, [_spec(x) for x in leaves])).lower(*leaves).compile()


def device_digests(mesh: Mesh, specs: Sequence[P]) -> Any:
    """A function of the chosen leaves (``specs``: their layouts on ``mesh``) to every device's digest of its own
    blocks, to be traced into a program: shaped like the mesh's devices, or, where the mesh spans processes,
    gathered onto every device in the same program (each process reads the others' from its own device:
    :func:`read_digests`)."""
    gather = _spans_processes(mesh)
    ones = (1,) * len(mesh.axis_names)

    def local(*blocks: jax.Array) -> jax.Array:
        total = jnp.uint32(0)
        for block in blocks:
            total = total * jnp.uint32(_GOLDEN) + _leaf_digest(block)
        if gather:
            return lax.all_gather(total, axis_name=tuple(mesh.axis_names))
        return total.reshape(ones)

    out = P() if gather else P(*mesh.axis_names)
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out, check_vma=False)


def digests_sharding(mesh: Mesh) -> NamedSharding:
    """The layout of :func:`device_digests`' output on ``mesh``."""
    return NamedSharding(mesh, P() if _spans_processes(mesh) else P(*mesh.axis_names))


def read_digests(out: jax.Array, mesh: Mesh) -> np.ndarray:
    """:func:`device_digests`' output on the host, shaped like the mesh's devices (blocks until computed)."""
    if _spans_processes(mesh):  # every digest was gathered on every device: read from this process's first
        return np.asarray(out.addressable_data(0)).reshape(mesh.devices.shape)
    return np.asarray(jax.device_get(out))


def replicated_leaves(abstract: PyTree, axis: str) -> list[int]:
    """The positions (in ``jax.tree.leaves`` order) of the leaves of ``abstract`` (arrays or ShapeDtypeStructs with
    their shardings) that every replica along ``axis`` holds whole: the ones the fingerprint compares."""
    return [i for i, x in enumerate(jax.tree.leaves(abstract)) if _replicated_over(x.sharding, axis)]


def _spans_processes(mesh: Mesh) -> bool:
    """Whether ``mesh`` holds devices of other processes (a group's, under ``launch``)."""
    here = jax.process_index()
    return any(d.process_index != here for d in mesh.devices.flat)


def compare_replicas(digests: np.ndarray, mesh: Mesh, replica_axis: str, *, step: int) -> Divergence | None:
    """The replicas along ``replica_axis`` of every block, compared; None when all agree."""
    axis = mesh.axis_names.index(replica_axis)
    values = np.moveaxis(digests, axis, -1)
    devices = np.moveaxis(np.vectorize(lambda d: d.id)(mesh.devices), axis, -1)
    replicas = values.shape[-1]
    suspects: list[int] = []
    seen: dict[int, str] = {}
    attributed = True
    for index in np.ndindex(values.shape[:-1]):
        group = [int(v) for v in values[index]]
        if len(set(group)) == 1:
            continue
        ids = [int(d) for d in devices[index]]
        seen.update({d: f"{v:08x}" for d, v in zip(ids, group, strict=True)})
        common, count = Counter(group).most_common(1)[0]
        if count * 2 > replicas:
            suspects += [d for d, v in zip(ids, group, strict=True) if v != common]
        else:
            attributed = False
            suspects += ids
    if not suspects:
        return None
    return Divergence(step, tuple(sorted(set(suspects))), seen, replicas, attributed)


class Integrity:
    """When to fingerprint the state, the check itself, and what a divergence found means (see the module's
    docstring). Runs in the step loop's thread.

    Args:
        every: fingerprint every ``every`` committed steps; None: as often as costs at most ``budget`` of a step
            (measured: every step where the digest is that cheap, as on an accelerator; sparser on CPU devices,
            where the replicas share the host's memory bandwidth).
        replica_axis: the data-parallel axis whose replicas must agree.
        budget: the share of a step the fingerprints may cost, with ``every`` None.

    A divergence found at step ``k`` is replayed: the run goes back to the newest verified state and steps to
    ``k`` again, checked there. Agreeing, it was transient (healed); disagreeing again, or on a device that was a
    suspect before, it is persistent (the devices are evicted).
    """

    def __init__(self, every: int | None, replica_axis: str, budget: float = 0.01) -> None:
        self.fingerprinter = Fingerprinter(replica_axis)
        self.replica_axis = replica_axis
        self.fixed = every
        self.every = every or 1
        self.budget = budget
        self.cost_s: float | None = None  # a digest's time, smoothed
        self.last = 0  # the newest step checked
        self.replaying: Divergence | None = None  # a divergence whose step is replayed, to tell which kind it is
        self.evicting: Divergence | None = None  # a persistent one: its devices go; healed once the step agrees
        self.found_at = 0.0  # when the divergence under way was found
        self.suspected: Counter[int] = Counter()  # devices found diverging, in all
        # Steps checked whatever the cadence: the durable tiers' (a multiple of each) and the run's last, so that
        # no state that was not verified is written there (the RAM tier hands them verified snapshots only).
        self.durable_every: tuple[int, ...] = ()
        self.final = 0

    def due(self, step: int) -> bool:
        pending = [d.step for d in (self.replaying, self.evicting) if d is not None]
        return step in pending or self.durable_due(step) or step >= self.last + self.every

    def durable_due(self, step: int) -> bool:
        """Whether ``step`` is one a durable tier saves (a multiple of its cadence, or the run's last): checked
        whatever the cadence, and its snapshot records the state's digest (:func:`state_digest`)."""
        return any(every > 0 and step % every == 0 for every in self.durable_every) or step == self.final

    def check(self, state: PyTree, step: int, step_s: float | None) -> Healed | None:
        """Compare the replicas of ``state`` (after ``step``); returns the divergence this check heals, if any.

        Raises:
            StateDiverged: the replicas disagree.
        """
        if not self.fingerprinter.covers(state):
            return None
        started = time.perf_counter()
        digests, mesh = self.fingerprinter.digests(state)
        self._adapt(time.perf_counter() - started, step_s)
        return self.verdict(digests, mesh, step)

    def verdict(self, digests: np.ndarray, mesh: Mesh, step: int) -> Healed | None:
        """:meth:`check` of digests computed already (every device's, shaped like ``mesh``'s devices: those a step
        compiled with its fingerprint returns, ``StepCompiler(fingerprint=...)``).

        Raises:
            StateDiverged: the replicas disagree.
        """
        self.last = step
        divergence = compare_replicas(digests, mesh, self.replica_axis, step=step)
        if divergence is None:
            pending = self.evicting or self.replaying
            if pending is None or step < pending.step:
                return None
            healed = Healed(pending, self.evicting is not None, time.monotonic() - self.found_at)
            self.replaying = self.evicting = None
            return healed
        again = self.replaying is not None and step == self.replaying.step
        before = any(self.suspected[d] for d in divergence.suspects)
        self.suspected.update(divergence.suspects)
        self.found_at = time.monotonic() if self.replaying is None and self.evicting is None else self.found_at
        if again or before:
            self.replaying, self.evicting = None, divergence
            raise StateDiverged(divergence, persistent=True)
        self.replaying = divergence
        raise StateDiverged(divergence, persistent=False)

    def _adapt(self, cost_s: float, step_s: float | None) -> None:
        """With no cadence given: every N steps, N the least that keeps the digests within the budget."""
        self.cost_s = cost_s if self.cost_s is None else 0.8 * self.cost_s + 0.2 * cost_s
        if self.fixed is None and step_s:
            self.every = max(1, math.ceil(self.cost_s / (self.budget * step_s)))
