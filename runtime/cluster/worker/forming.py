"""Forming a group in a worker process: leaving the old ``jax.distributed`` group, joining the new one, laying the
job out on its mesh (seat, shardings, compiled step, snapshot and restore programs) and saying what it can restore
(``Joined``); and warming a spare up while it waits.
"""

from __future__ import annotations

import contextlib
import logging
import time
from functools import partial
from pathlib import Path

import numpy as np

from elastic_runtime.cluster.collectives import NeighbourShift, SliceRestore
from elastic_runtime.cluster.protocol import Form, Joined, Stop
from elastic_runtime.cluster.worker.group import join_group, leave_group
from elastic_runtime.cluster.worker.refill import best_local, local_steps
from elastic_runtime.cluster.worker.state import WorkerState
from elastic_runtime.core.cadence import EveryN
from elastic_runtime.core.errors import MeshUnavailable
from elastic_runtime.core.fingerprint import Integrity
from elastic_runtime.core.initial import initial_program
from elastic_runtime.core.process_data import local_rows
from elastic_runtime.faults.process import attach_worker_faults
from elastic_runtime.storage.boxes import local_like, uses_axis
from elastic_runtime.storage.replicas import run_identity
from elastic_runtime.storage.sharded import ShardedStore, writes

__all__ = ["form_group", "programs_folder", "shared_cache", "warm_up"]

log = logging.getLogger(__name__)

# How long a new group waits for an abandoned restore that may still be reading its shards.
_RESTORE_SETTLE_S = 2.0
# Steps after a re-forming until a full garbage collection. A survivor whose step failed kept the old group's
# backend, its gloo thread polling (a third of a step on 2 cores; bench_after_loss.py), until one came, and
# Python's come rarely (with the step's traceback dropped too: stepping.py). One takes about 0.1 s: not on the
# recovery's path.
COLLECT_AFTER_STEPS = 20


def form_group(worker: WorkerState, form: Form) -> None:
    import jax
    import jax.extend.backend

    from elastic_runtime.core.compiler import StepCompiler

    started = time.monotonic()
    worker.smaller.stop()  # its compile runs on the backend about to go
    worker.deferred = None
    worker.form = form
    if form.run_id and not worker.identity:
        # Started by a cluster, not by launch: the run's id comes with the first Form, before any replica
        # is read or written, so that only this run's replicas are ever restored here too.
        worker.identity = run_identity(form.run_id, worker.template, worker.target_steps)
    worker.fences = dict(form.fences)
    if form.faults:
        attach_worker_faults(worker, form.faults)
    if worker.abandoned_restore is not None:
        # Reading files, it ends soon (and then stops before touching JAX); waiting for the others' reads, at
        # once (group.meet); blocked in a collective, never.
        with contextlib.suppress(Exception):
            worker.abandoned_restore.result(timeout=_RESTORE_SETTLE_S)
        worker.abandoned_restore = None
    if worker.in_a_group.is_set():
        keep_host_copies(worker)
        leave_group()
        jax.extend.backend.clear_backends()
        worker.core.state = None  # it lived on the old backend
        worker.collect_in = COLLECT_AFTER_STEPS
    left = time.monotonic()
    if not join_group(form, worker.settings, partial(given_up, worker, form.generation)):
        log.warning("worker %d: generation %d given up before it formed", worker.worker, form.generation)
        return
    if jax.process_count() != form.num_processes:
        # Another thread asked JAX between leaving the old group and joining this one, which brought up a
        # backend outside any group: drop it, so the next call brings up the group's.
        log.warning("worker %d: a backend outside the group was up; cleared", worker.worker)
        jax.extend.backend.clear_backends()
    connected = time.monotonic()
    worker.programs.reset(programs_folder(worker, form.programs))
    worker.in_a_group.set()
    worker.generation, worker.process_id, worker.num_processes = form.generation, form.process_id, form.num_processes
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    # The replica axis spans the slices; the other axes span the devices of every process of a slice (with
    # one process per slice, the devices of that process).
    slices = form.num_processes // form.slice_size
    process_mesh = worker.job.process_mesh
    try:
        worker.mesh = process_mesh.build(devices, slices)
    except MeshUnavailable as exc:
        worker.unsupported(str(exc))
        return
    place = (form.process_id, form.num_processes)
    # With neighbour replicas every replica is read (the neighbour's copy is made from it): none is a spare.
    spare = worker.settings.spare_states and not form.neighbour_replicas
    # The slices' copies of the state compared after every step (silent data corruption), with two or more: the
    # step returns its digests. A new group starts with no suspects: its devices' ids may belong to other
    # processes now.
    compared = process_mesh.replica_axis if worker.fingerprint and slices >= 2 else None
    worker.integrity = None if compared is None else Integrity(1, compared)
    compiler = StepCompiler(
        worker.job,
        worker.template,
        worker.batch_like,
        into_spare=spare,
        fingerprint=compared,
        programs=worker.programs,
        place=place,
    )
    worker.state_shardings = compiler.state_shardings(worker.mesh)
    worker.batch_shardings = compiler.batch_shardings(worker.mesh)
    worker.batch_rows = local_rows(worker.batch_shardings, worker.batch_like)  # this mesh's rows (process_data.py)
    replica = process_mesh.replica_axis
    over_replica = uses_axis(worker.state_shardings, worker.template, replica)
    if over_replica:
        # The replica axis shrinks when a slice is lost: a state split over it would lose shards with it.
        names = ", ".join(over_replica[:3]) + (f" and {len(over_replica) - 3} more" if len(over_replica) > 3 else "")
        message = (
            f"the state is sharded across processes over the {replica!r} axis: {names}; {replica!r} is the "
            "replica axis across slices, which shrinks when one is lost: shard the state over the axes inside "
            f"a slice ({', '.join(map(repr, process_mesh.slice_axes))}), which span its processes (launch --slices)"
        )
        worker.unsupported(message)
        return
    position, local = form.process_id % form.slice_size, worker.settings.local_devices
    layout = f"position {position} of {form.slice_size} x {local} devices"
    if worker.ram is not None and worker.ram.metadata.get("layout") != layout:
        # Seated elsewhere in a slice: the shards it holds are not the ones it needs now.
        worker.ram = worker.neighbour = None
    worker.layout = {"layout": layout}
    worker.slice_size = form.slice_size
    worker.local_like = local_like(worker.template, worker.state_shardings)
    if form.durable_dir and (worker.durable is None or worker.durable.location != form.durable_dir.rstrip("/")):
        worker.durable = ShardedStore(form.durable_dir)
    # The replica file's cadence (every step unless the controller judged the state held elsewhere), and the
    # durable tier's. A durable step always gets its file too (``training.train``).
    worker.core.ledger.policies = {"file": EveryN(max(1, form.file_every))}
    worker.file_after_s = form.file_after_s
    if form.durable_every > 0:
        worker.core.ledger.policies["durable"] = EveryN(form.durable_every)
    worker.owned = writes(worker.template, worker.state_shardings, form.slice_size)
    worker.compiled = compiler.get(worker.mesh)
    worker.spares.reset(form.generation, partial(compiler.fresh_buffers, worker.mesh) if spare else None)
    shift = form.neighbour_replicas
    kept = worker.programs
    worker.shift = (
        NeighbourShift(worker.template, worker.state_shardings, replica=replica, programs=kept) if shift else None
    )
    worker.restorer = SliceRestore(
        worker.template, worker.state_shardings, neighbours=shift, replica=replica, programs=kept
    )
    if worker.shift is None:
        worker.neighbour = None
    # A process that never held a step may start from the initial state: its program is compiled (or loaded)
    # here, in the join's time, not in the restore's, which the hang monitor times.
    fresh = worker.ram is None and worker.step == 0
    worker.initial = (
        initial_program(worker.job, worker.state_shardings, worker.mesh, programs=kept, place=place) if fresh else None
    )
    compiled = time.monotonic()
    best, tier = best_local(worker, form.read_files)
    kept = worker.programs
    # wait: from the Form's arrival to this join's start (a step in flight finished or abandoned first, a
    # warm-up under way, a planned re-forming's step reached).
    waited = max(0.0, started - worker.link.form_arrived) if worker.link.form_arrived else 0.0
    phases = {"wait": waited, "leave": left - started, "connect": connected - left, **kept.seconds}
    phases["read"] = time.monotonic() - compiled
    log.info(
        "joined generation %d as process %d/%d in %.3f s: %s; traced %s, loaded %s",
        form.generation,
        form.process_id,
        form.num_processes,
        time.monotonic() - started,
        ", ".join(f"{phase} {seconds:.3f} s" for phase, seconds in phases.items()),
        ", ".join(kept.traced) or "nothing",
        ", ".join(kept.loaded) or "nothing",
    )
    shape = {str(name): int(size) for name, size in worker.mesh.shape.items()}
    if not worker.mesh_history or worker.mesh_history[-1] != shape:
        worker.mesh_history.append(shape)
    worker.link.send(
        Joined(
            worker=worker.worker,
            generation=worker.generation,
            best_step=best,
            tier=tier,
            steps=tuple(sorted(local_steps(worker) | worker.durable_steps)),
            durable_only=tuple(sorted(worker.durable_steps - local_steps(worker))),
            neighbour_step=worker.neighbour.step if worker.neighbour is not None else 0,
            join_s=time.monotonic() - started,
            skipped=worker.skipped,
            phases=phases,
            traced=tuple(kept.traced),
            mesh_shape=shape,
        )
    )


def given_up(worker: WorkerState, generation: int) -> bool:
    """Whether the controller gave up ``generation``, being joined: a later one's Form, or a Stop, waits in the
    inbox. (A Form of the same generation, sent again, is no reason to leave it.)"""
    with worker.link.inbox.mutex:
        waiting = list(worker.link.inbox.queue)
    return any(
        (isinstance(m, Form) and m.generation > generation) or (isinstance(m, Stop) and not m.hold) for m in waiting
    )


def keep_host_copies(worker: WorkerState) -> None:
    """Make the RAM replica's host copy now if its writer has not: its arrays live on the backend about to go.
    The step that made them completed; reading this process's own shards needs no peer. The writer may be
    copying an older replica's arrays from that backend: it finishes first."""
    worker.replicas.wait()
    ram = worker.ram
    if ram is None:
        return
    try:
        ram.tree  # noqa: B018 - the first read makes the copy
    except Exception as exc:  # the group restores from what the others hold (or older files)
        log.warning("worker %d: RAM replica of step %d lost: %s: %s", worker.worker, ram.step, type(exc).__name__, exc)
        worker.ram = None


def warm_up(worker: WorkerState, programs: str) -> None:
    """Trace and compile the step once on a local, non-distributed backend, then drop that backend.

    The first compile in a process pays for loading and initializing XLA's compiler and JAX's tracing
    machinery (seconds here); a spare that paid it while idle joins a re-forming group sooner. Where the
    run's kept ``programs`` are on this host already, joining loads them: only the backend is brought up
    (a fraction of a second), since a real model's warm-up compile (minutes on CPU) keeps the spare deaf
    to the Form of a group that needs it.
    """
    import jax
    import jax.extend.backend

    from elastic_runtime.core.compiler import StepCompiler

    started = time.monotonic()
    kept = programs_folder(worker, programs)
    try:
        if kept is not None and kept.is_dir() and any(kept.iterdir()):
            jax.block_until_ready(jax.jit(lambda x: x + 1)(np.float32(0)))
            log.info("the run's programs are kept on this host: only the backend warmed up")
            return
        mesh = worker.job.process_mesh.build(jax.local_devices(), 1)
        StepCompiler(worker.job, worker.template, worker.batch_like).get(mesh)
    except Exception as exc:  # only an optimization: a spare that cannot warm up joins cold
        log.warning("warm-up failed: %s: %s", type(exc).__name__, exc)
    finally:
        jax.extend.backend.clear_backends()
    log.info("warmed up in %.3f s", time.monotonic() - started)


def programs_folder(worker: WorkerState, name: str) -> Path | None:
    """Where the group keeps its compiled programs (``Form.programs`` names the folder; runtime/core/programs.py).

    In the compile cache when the cluster gives every host the same one (``ELASTIC_COMPILE_CACHE`` outside this
    host's replica folder: service mode, several hosts): a replacement on a new host then loads the programs its
    seat ran instead of compiling them. JAX's own persistent cache does not do that on CPU: only process 0
    writes it, and another process's cache key differs from process 0's (seen here: process 1 of 2 missed the
    entry process 0 wrote for the same program). Else beside the replica files, which this host's processes
    share (``launch``: its compile cache is in that folder too)."""
    if not name:
        return None
    shared = shared_cache(worker)
    return (shared if shared is not None else worker.replicas.directory) / name


def shared_cache(worker: WorkerState) -> Path | None:
    """The compile cache the cluster gives every host (``ELASTIC_COMPILE_CACHE`` outside this host's replica
    folder), or None (``launch``: the cache is in the replica folder, which only this host's processes see)."""
    cache = worker.settings.compile_cache
    if cache and "://" not in cache and not Path(cache).resolve().is_relative_to(worker.replicas.directory.resolve()):
        return Path(cache)
    return None
