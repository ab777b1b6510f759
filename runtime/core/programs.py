"""Compiled programs kept as serialized executables: a program needed again on a new backend is loaded, not
traced and compiled again.

Under ``launch`` every re-forming of the group brings up a new backend (``jax.distributed`` re-initialized),
and nothing compiled on the old one runs on it: without this, each survivor traced and compiled the user's step
again (45 s for a small MaxText model on CPU), although the layout (mesh shape, device ids, this process's
place in the group) was the same as before. JAX can serialize a compiled executable and load it on another
client (``jax.experimental.serialize_executable``; 3 ms for the demo's step). A program is kept under a key
that names everything its compiled form depends on besides the code: its name, the layout, the JAX version.

Kept in memory, for this process's next generations; and, with a ``folder``, written to a file there for a
replacement process taking the same place in the group (a spare on the same host): the controller hands each
run its own folder (``Form.programs``), so a file is never taken for another run's or another version of the
script's. A file is signed with the run's secret (HMAC-SHA256) and loaded only when the signature holds:
a serialized executable is a pickle, and loading one runs code.

A program is also kept by its mesh's shape (axis names and sizes, the processes it spans): compiled code names
places in the mesh, not devices (``elastic_runtime.core.same_shape``), so a layout of that shape that was never compiled
for (a group one slice smaller, on a new backend: ``elastic_runtime.cluster.worker.smaller``) loads it onto its own
devices, each in the place the compiled mesh's device had (``elastic_runtime.compat.jax.load_executable_onto``). That
takes the user's step to lower the same on every mesh of a shape, as a step written against axis names does; one
that reads its devices' ids does not (run it with ``ELASTIC_PREPARE_SMALLER=0``). In one process, where tracing
is not what is saved, ``elastic_runtime.core.same_shape`` compares the lowered programs instead.

Where the time goes (``seconds``: tracing and lowering, XLA's compile, loading) is kept for the events: the
report separates it from restoring.

A program that JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) gave instead of compiling it
is not kept: serialized again, such an executable lacks part of its code on CPU (jax 0.10: it loads, and its
first run fails with ``NOT_FOUND: Function ... not found``; ``tests/test_programs_cache.py``). A group whose
kept restore program came from the cache gave up its run after a re-form. The next generation traces it and
loads it from that cache again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable
from jax.sharding import Mesh

from elastic_runtime.compat.jax import load_executable_onto
from elastic_runtime.core.mesh import mesh_key

log = logging.getLogger(__name__)

__all__ = ["ProgramStore", "Stopped", "compile_kept", "compile_noting_cache", "serialized"]


_SIGNATURE = 32  # bytes of HMAC-SHA256 before the payload
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # recorded by JAX in the thread whose compile the cache served
_cache_hits = threading.local()


def _count_cache_hit(event: str, **_: Any) -> None:
    if event == _CACHE_HIT:
        _cache_hits.count = getattr(_cache_hits, "count", 0) + 1


jax.monitoring.register_event_listener(_count_cache_hit)


class Stopped(Exception):
    """A compile that ended after the thread that asked for it was told to stop (``ProgramStore.compiling_outside``)."""


class ProgramStore:
    """Serialized executables by key, in memory and optionally in a folder shared with other processes.

    Args:
        secret: signs and checks the files; without one the store keeps programs in memory only.
        keep: False: keep nothing, compile every time (only counting the time; for comparisons).
    """

    def __init__(self, secret: str = "", *, keep: bool = True) -> None:
        self.folder: Path | None = None  # where to write programs for other processes, and to look for theirs
        self._secret = secret.encode()
        self._keep = keep
        self._kept: dict[str, bytes] = {}
        self._by_shape: dict[str, tuple[bytes, tuple[int, ...]]] = {}  # and the compiled mesh's device ids
        self.seconds: dict[str, float] = {"trace": 0.0, "compile": 0.0, "load": 0.0}
        self.loaded: list[str] = []  # names of the programs loaded, not traced, since the last reset
        self.traced: list[str] = []
        self._outside = threading.local()  # a thread's (lock, stop) while it compiles outside a lock

    def reset(self, folder: Path | None = None) -> None:
        """Start counting afresh (a new generation), sharing programs through ``folder`` from now on (only with
        a secret to sign them)."""
        if folder is not None and self._secret:
            self.folder = folder
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.loaded, self.traced = [], []

    @contextlib.contextmanager
    def compiling_outside(self, lock: threading.Lock, stop: threading.Event) -> Iterator[None]:
        """For this thread, in the block, which holds ``lock``: each XLA compile runs with ``lock`` released, so that
        another thread waiting for it (to take the backend away) waits for this thread's tracing, not for a compile
        of seconds; a compile that ends with ``stop`` set raises :class:`Stopped` before anything else is done."""
        self._outside.gate = (lock, stop)
        try:
            yield
        finally:
            self._outside.gate = None

    def compiled(self, name: str, mesh: Mesh, place: Hashable, lower: Callable[[], Any]) -> Any:
        """The program ``name`` for ``mesh`` (this process at ``place`` in its group): loaded when kept for this
        layout (in memory or in the folder) or for another of its shape, else ``lower()`` (a
        ``jax.stages.Lowered``) compiled, then kept. Runs on the current default backend."""
        ids = mesh_key(mesh)[2]
        key = _key(name, (mesh_key(mesh), place))
        shape_key = _key(name, _shape(mesh))
        started = time.perf_counter()
        program = None
        payload = self._kept.get(key) or self._read(key)
        if payload is not None:
            program = self._load(name, payload, {d.id: d for d in mesh.devices.flat})
            if program is None:
                self._kept.pop(key, None)
            else:
                self._kept[key] = payload  # read from the folder: kept in memory too
        if program is None and shape_key in self._by_shape:
            payload, compiled_ids = self._by_shape[shape_key]
            program = self._load(name, payload, dict(zip(compiled_ids, mesh.devices.flat, strict=True)))
        if program is not None:
            self.seconds["load"] += time.perf_counter() - started
            self.loaded.append(name)
            return program
        started = time.perf_counter()
        lowered = lower()
        traced = time.perf_counter()
        program, from_cache = self._compile(lowered)
        self.seconds["trace"] += traced - started
        self.seconds["compile"] += time.perf_counter() - traced
        self.traced.append(name)
        payload = serialized(program, name, from_cache) if self._keep else None
        if payload is None:
            return program
        self._kept[key] = payload
        self._by_shape[shape_key] = (payload, ids)
        self._write(key, payload)
        return program

    def _compile(self, lowered: Any) -> tuple[Any, bool]:
        gate = getattr(self._outside, "gate", None)
        if gate is None:
            return compile_noting_cache(lowered)
        lock, stop = gate
        lock.release()
        try:
            compiled = compile_noting_cache(lowered)
        finally:
            lock.acquire()
        if stop.is_set():
            raise Stopped("told to stop while compiling")
        return compiled

    def _load(self, name: str, payload: bytes, moved: dict[int, Any]) -> Any:
        """``payload`` loaded onto ``moved``'s devices, each in the place of the device whose id is its key (the
        same device for a program of this layout). None where it will not load."""
        try:
            executable, in_tree, out_tree = pickle.loads(payload)
            if all(device.id == id_ for id_, device in moved.items()):
                # Its own devices (not every device of the backend: a program of a smaller mesh has fewer).
                devices = list(moved.values())
                return serialize_executable.deserialize_and_load(
                    executable, in_tree, out_tree, execution_devices=devices
                )
            return load_executable_onto(executable, in_tree, out_tree, moved)
        except Exception as exc:  # a backend that cannot take it: compile as if it were not kept
            log.warning("could not load the kept %s (%s: %s); compiling it", name, type(exc).__name__, exc)
            return None

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()

    def _read(self, key: str) -> bytes | None:
        if self.folder is None:
            return None
        try:
            data = (self.folder / key).read_bytes()
        except OSError:
            return None
        signature, payload = data[:_SIGNATURE], data[_SIGNATURE:]
        if not hmac.compare_digest(signature, self._sign(payload)):
            log.warning("kept program %s is not signed with this run's secret: ignored", self.folder / key)
            return None
        return payload

    def _write(self, key: str, payload: bytes) -> None:
        if self.folder is None:
            return
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Whole or not at all: written aside, then renamed over.
            fd, temporary = tempfile.mkstemp(dir=self.folder, prefix=f".{key}-")
            with os.fdopen(fd, "wb") as f:
                f.write(self._sign(payload) + payload)
            os.replace(temporary, self.folder / key)
        except OSError as exc:  # only a speed-up for other processes
            log.warning("could not keep a program in %s: %s", self.folder, exc)


def compile_noting_cache(lowered: Any) -> tuple[Any, bool]:
    """``lowered`` compiled, and whether JAX's persistent compilation cache gave it instead of XLA."""
    hits = getattr(_cache_hits, "count", 0)
    program = lowered.compile()
    return program, getattr(_cache_hits, "count", 0) != hits


def serialized(program: Any, name: str, from_cache: bool) -> bytes | None:
    """``program`` serialized (``serialize_executable.serialize``, pickled), or None where it cannot be: it came
    from JAX's persistent cache (incomplete on CPU, see above), or it holds what cannot be serialized."""
    if from_cache:
        log.info("the %s came from JAX's persistent compilation cache: not kept (see programs.py)", name)
        return None
    try:
        return pickle.dumps(serialize_executable.serialize(program))
    except Exception as exc:  # some programs cannot be serialized (closed-over constants): traced each time
        log.info("the %s cannot be kept: %s: %s", name, type(exc).__name__, exc)
        return None


def compile_kept(
    programs: ProgramStore | None, name: str, mesh: Mesh, place: Hashable, lower: Callable[[], Any]
) -> Any:
    """``lower()`` compiled; with ``programs``, loaded from it when kept there for ``mesh`` and ``place`` or for
    another mesh of the shape (else compiled and kept): what every program of a re-formable group is built with."""
    if programs is None:
        return lower().compile()
    return programs.compiled(name, mesh, place, lower)


def _key(name: str, layout: Hashable) -> str:
    return hashlib.sha256(repr((name, layout, jax.__version__)).encode()).hexdigest()[:32]


def _shape(mesh: Mesh) -> tuple[Any, ...]:
    """What a program's compiled code depends on of its mesh: its axes, and how many processes its devices are in
    (its collectives cross that many), not which devices they are."""
    names, sizes, _ = mesh_key(mesh)
    return names, sizes, len({d.process_index for d in mesh.devices.flat})
