"""One compile for every mesh of the same shape: a program compiled for one mesh is loaded onto another's devices.

On CPU JAX keys a compile by its device assignment too, so compiling ahead for each likely degraded mesh (one
slice fewer: one mesh per slice that can be lost) compiled the same program once per slice (for MaxText here 2-3 s
each with its layers unrolled, 40-90 s scanned), one after another on the machine's spare core; a failure on the
last slice waited for all of them.
Yet XLA's compiled code names no device: a program's shardings name places in the mesh, and only the
executable's device assignment says which device takes each place. So the first mesh of a shape is compiled and
its executable serialized, and every other mesh whose lowered program is the same text loads it with its own
devices in the same places (milliseconds: ``elastic_runtime.compat.jax.load_executable_onto``).

The lowered text is compared, not assumed: a step built per concrete mesh may lower differently, and is then
compiled on its own. Tracing is the price, a fraction of a compile.

Only on CPU, where it is checked (results bitwise equal to a compile of their own: ``tests/test_same_shape.py``);
on GPU JAX's cache already leaves the device assignment out of its key. A program that JAX's persistent cache
gave cannot be serialized whole on CPU (``elastic_runtime.core.programs``): in a resumed run, whose first meshes come
from that cache, the next mesh compiled for real serves the rest.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import threading
from concurrent.futures import Future
from typing import Any

from jax.sharding import Mesh

from elastic_runtime.compat.jax import load_executable_onto
from elastic_runtime.core.mesh import mesh_key
from elastic_runtime.core.programs import compile_noting_cache, serialized

log = logging.getLogger(__name__)

__all__ = ["SameShape"]


class _Source:
    """A program compiled for one mesh, serialized on first request (a mesh alone in its shape never is)."""

    def __init__(self, name: str, program: Any, device_ids: tuple[int, ...]) -> None:
        self.name, self.program, self.device_ids = name, program, device_ids  # the mesh's devices in layout order
        self._lock = threading.Lock()
        self._payload: bytes | None = None
        self._tried = False

    def payload(self) -> bytes | None:
        with self._lock:
            if not self._tried:
                self._payload, self._tried = serialized(self.program, self.name, from_cache=False), True
            return self._payload


class SameShape:
    """Compiled programs by name and lowered text, each loaded onto every mesh that lowers it the same. Thread-safe:
    a mesh whose program is being compiled for another waits for that compile instead of starting its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[tuple[str, str], Future[_Source | None]] = {}
        self.loaded: dict[tuple[int, ...], int] = {}  # by a mesh's device ids: its programs loaded, not compiled

    def compiled(self, name: str, mesh: Mesh, lowered: Any) -> Any:
        """``lowered`` (the program ``name`` lowered for ``mesh``) compiled, or loaded from the same program
        compiled for another mesh."""
        if mesh.devices.flat[0].platform != "cpu":
            return lowered.compile()
        key = (name, hashlib.sha256(lowered.as_text().encode()).hexdigest())
        with self._lock:
            source = self._sources.get(key)
            owner = source is None
            if owner:
                source = self._sources[key] = Future()
        assert source is not None
        ids = mesh_key(mesh)[2]  # its devices in layout order
        kept = None if owner else source.result()
        payload = kept.payload() if kept is not None and kept.device_ids != ids else None
        if kept is not None and payload is not None:
            try:
                executable, in_tree, out_tree = pickle.loads(payload)
                moved = dict(zip(kept.device_ids, mesh.devices.flat, strict=True))
                program = load_executable_onto(executable, in_tree, out_tree, moved)
            except Exception as exc:  # only a shortcut: compile as if there were no other mesh
                log.warning("could not load the %s onto %s (%s: %s); compiling it", name, ids, type(exc).__name__, exc)
            else:
                with self._lock:
                    self.loaded[ids] = self.loaded.get(ids, 0) + 1
                return program
        try:
            program, from_cache = compile_noting_cache(lowered)
        except BaseException:
            if owner:
                source.set_result(None)  # the others compile on their own, and meet the error themselves
            raise
        compiled = None if from_cache else _Source(name, program, ids)
        if owner:
            source.set_result(compiled)
        elif compiled is not None and kept is None:  # the first came from JAX's cache (a resumed run): this serves
            done: Future[_Source | None] = Future()
            done.set_result(compiled)
            with self._lock:
                self._sources[key] = done
        return program
