"""The group one slice smaller, prepared while this one trains: a re-form without a lost slice loads its programs,
it does not trace them.

Where the group may go on without a lost slice (``Form.min_processes`` at most its size less a slice: launch's
``--min-nprocs``, the service mode's orchestrator-replaced workers), the survivors re-form on a new backend, and
every program of the smaller layout (the step, its spare state's maker, the restore and neighbour programs) is new
to them: each survivor traced and compiled them all during the re-form. Yet compiled code names places in the
mesh, not devices (``elastic_runtime.core.same_shape``). So each member compiles them now, on the current backend, for a
mesh of the smaller shape made of this group's devices less one other slice, and its ``ProgramStore`` keeps them
by shape: in the smaller group it loads them onto its new devices (``ProgramStore.compiled``).

In a thread, after the group restored its state, one program set at a time, under a lock it releases while XLA
compiles: a re-form or a stop waits for a trace under way (the backend it runs on is about to go), not for a
compile, which runs on and is dropped; no other starts. When all are kept the worker reports
``LikelyMeshesReady`` (``meshes`` 1: the layout one slice smaller).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from elastic_runtime.cluster.protocol import EventReport, Form
from elastic_runtime.cluster.worker.state import WorkerState
from elastic_runtime.core.events import LikelyMeshesReady
from elastic_runtime.core.mesh import mesh_shape
from elastic_runtime.core.programs import Stopped

__all__ = ["SmallerGroup"]

log = logging.getLogger(__name__)


class SmallerGroup:
    """Prepares the programs of the group one slice smaller than the current one, in the background."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held while the preparation uses the current backend, but for XLA's compiles
        self._stop = threading.Event()  # the current preparation's: each has its own
        self._prepared: set[tuple[int, int]] = set()  # (processes, slice size) of the groups prepared for

    def start(self, worker: WorkerState, form: Form) -> None:
        """Prepare the group one slice smaller than ``form``'s, if the group may go on that small and it is not
        prepared yet."""
        smaller = (form.num_processes - form.slice_size, form.slice_size)
        wanted = worker.settings.prepare_smaller and worker.settings.keep_programs  # kept, or compiled for nothing
        may_form = 1 <= form.min_processes <= smaller[0]  # 0: the controller did not say
        if not (wanted and may_form) or smaller in self._prepared:
            return
        self._stop = stop = threading.Event()
        threading.Thread(target=self._prepare, args=(worker, form, smaller, stop), name="smaller", daemon=True).start()

    def stop(self) -> None:
        """Wait for a trace under way and start nothing more (a compile under way is dropped when it ends): the
        backend is about to go."""
        self._stop.set()
        with self._lock:
            pass

    def _prepare(self, worker: WorkerState, form: Form, smaller: tuple[int, int], stop: threading.Event) -> None:
        started = time.monotonic()
        sets = _program_sets(worker, form, smaller)
        while True:
            # Released while XLA compiles: a re-form waits for a trace, not for a compile (which runs on, on the
            # old backend, and is dropped: Stopped).
            with self._lock, worker.programs.compiling_outside(self._lock, stop):
                if stop.is_set():
                    log.info("worker %d: re-forming; the smaller group's programs not all kept", worker.worker)
                    return
                try:
                    if next(sets, None) is None:
                        break
                except Stopped:
                    log.info("worker %d: re-forming; the smaller group's compile under way dropped", worker.worker)
                    return
                except Exception as exc:  # only a speed-up: the smaller group compiles them if it ever forms
                    why = f"{type(exc).__name__}: {exc}"
                    log.warning("worker %d: preparing the smaller group failed: %s", worker.worker, why)
                    return
        self._prepared.add(smaller)
        seconds = time.monotonic() - started
        log.info("worker %d: programs of the group of %d processes kept in %.3f s", worker.worker, smaller[0], seconds)
        ready = LikelyMeshesReady(
            step=worker.step, source="worker", mesh_shape=mesh_shape(worker.mesh), meshes=1, seconds=seconds
        )
        worker.link.send(EventReport(worker=worker.worker, generation=form.generation, event=ready))


def _program_sets(worker: WorkerState, form: Form, place: tuple[int, int]) -> Iterator[str]:
    """Compiles the smaller group's programs on the current backend, for a mesh of its shape made of this group's
    devices less another slice than this process's; yields after each set (kept in ``worker.programs``)."""
    import jax

    from elastic_runtime.cluster.collectives import NeighbourShift, SliceRestore
    from elastic_runtime.core.compiler import StepCompiler

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    slices = form.num_processes // form.slice_size
    per_slice = len(devices) // slices
    dropped = (form.process_id // form.slice_size + 1) % slices
    mesh = worker.job.process_mesh.build(
        devices[: dropped * per_slice] + devices[(dropped + 1) * per_slice :], slices - 1
    )
    spare = worker.settings.spare_states and not form.neighbour_replicas
    kept = worker.programs
    replica = worker.job.process_mesh.replica_axis
    compared = replica if worker.fingerprint and slices - 1 >= 2 else None  # as forming.py compiles it
    compiler = StepCompiler(
        worker.job,
        worker.template,
        worker.batch_like,
        into_spare=spare,
        fingerprint=compared,
        programs=kept,
        place=place,
    )
    compiler.get(mesh)
    yield "step"
    shardings = compiler.state_shardings(mesh)
    SliceRestore(worker.template, shardings, neighbours=form.neighbour_replicas, replica=replica, programs=kept)
    yield "restore"
    if form.neighbour_replicas:
        NeighbourShift(worker.template, shardings, replica=replica, programs=kept)
        yield "neighbour shift"
