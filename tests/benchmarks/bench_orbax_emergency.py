"""Against Orbax's own emergency checkpointing (issue 19): the same state, processes and loss, side by side in one
run. Not collected by pytest.

    PYTHONPATH=. .venv/bin/python tests/benchmarks/bench_orbax_emergency.py [--mb 32] [--repeats 3] [--json out.json]
        [--cases orbax_1slice,orbax_2slice,ours,ours_blocking,orbax_2slice_lost0]

The demo model (``runtime/testing/demo_model.py``) scaled to about ``--mb`` MB of state (as in
``bench_slices.py``), 4 processes x 2 CPU devices (gloo), the hidden layer sharded over the ``model`` axis, 30
steps, ``kill -9`` of process 2 once step 15 is done and persistent/durable step 10 is committed, its local tier
(``/dev/shm`` folder) deleted. Each case is a fresh run, in this order every repeat:

- ``orbax_1slice``: ``orbax.checkpoint.experimental.emergency.CheckpointManager`` on our exact mesh (1 x 8:
  ``data`` 1, ``model`` 8), local options every step (keep 2), persistent every 5 steps (async), a local folder
  per process in ``/dev/shm`` and the persistent folder on local disk. With one replica along the replica axis
  Orbax drops the local folder (``del local_directory``) and saves only the persistent tier: see
  docs/benchmarks.md. Restart on loss: every process is killed and started again (new coordinator), restores
  the newest step (``latest_step``, ``restore``) and trains on;
- ``orbax_2slice``: the layout Orbax's local tier needs: 2 replicas along ``data`` (processes 0-1 and 2-3), the
  state sharded over ``model`` inside each and so held twice (each process holds half of it, not a quarter);
  the primary replica saves persistent every 5 steps, the other local every step; process 2's local folder is
  lost, then the same restart; ``orbax_2slice_lost0`` (only with ``--cases``): process 0 of the primary replica
  lost instead, so that the other replica's local tier serves the restore;
- ``ours``: our runtime (``elastic-runtime launch``'s controller, a warm spare), the durable tier a local-disk
  folder every 5 steps, replica files in ``/dev/shm`` every step: the survivors keep their processes and shards,
  only process 2's shards come from the durable tier;
- ``ours_blocking``: what our worker's loop blocks on per committed step, timed in 4 processes of this file's
  own harness on the same mesh and step: ``local_copy(state)`` (device to host, this process's boxes),
  ``replica(...)`` and ``ReplicaFiles.save`` (which first waits for the previous replica write), and every 5
  steps the hand-off of the durable write (``ShardedStore.write`` of this process's part) to its thread, as
  ``elastic_runtime.cluster.worker.training.train`` does. The training loop itself of ``ours`` is not instrumented.

Times: ``blocking_save_s`` is per step, the median over the steps of each process, then over the 4 processes;
``next_commit_s`` is from the kill (the controller's ``WorkerKilled``; for Orbax the line process 2 writes just
before it sends itself SIGKILL; every process here shares the machine's monotonic clock) to the first step
trained and committed after it (for Orbax: by every process, its ``save`` call returned). Bytes per step are
measured from the checkpoints left on disk at the end (every step of a tier has the same arrays); totals are
bytes per step times the saves made.

Orbax's emergency manager needs two things a plain JAX program does not do, both done here as Orbax's own
emergency benchmark does: ``multihost.initialize_runtime_to_distributed_ids()`` and
``initialize_distributed_to_device_ids()`` after ``jax.distributed.initialize`` (a local save fails without
them), and parsed absl flags (a restore from the local tier reads one). Every run is bounded
(``RUN_TIMEOUT_S`` a group) and removes its processes, ``/dev/shm`` folders and temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

STEPS, KILL_AT, EVERY, LOST = 30, 15, 5, 2
PROCESSES = 4
GLOBAL_BATCH = 96
RUN_TIMEOUT_S = 300.0  # one group's run, start to finish


# --- the workers (this file with --worker) ------------------------------------------------------------------


def worker_main(args: argparse.Namespace) -> None:
    """One process of the harness: train the demo model on the shared mesh, saving as ``args.mode`` says, and
    write one JSON line per event to ``args.log``."""
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 (open for the process's life)

    def note(event: str, **fields: Any) -> None:
        log.write(json.dumps({"ev": event, "t": time.monotonic(), "pid": args.process_id, **fields}) + "\n")

    note("started")
    import jax
    from absl import flags
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.INFO)  # Orbax says which tier it restores from
    # Orbax reads absl flags (--experimental_use_distributed_id_for_mesh_consistency, in a restore from the
    # local tier) and raises UnparsedFlagAccessError outside an absl app: take the defaults.
    flags.FLAGS.mark_as_parsed()
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    note("imported")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=PROCESSES,
        process_id=args.process_id,
        initialization_timeout=120,
    )
    note("connected")
    import numpy as np

    from elastic_runtime.core.compiler import StepCompiler
    from elastic_runtime.testing.demo_model import demo_job

    job = demo_job(global_batch=GLOBAL_BATCH, features=args.size, hidden=args.size)
    template = job.init()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices).reshape(args.slices, -1), ("data", "model"))
    compiler = StepCompiler(job, template, job.data.batch(0))
    shardings = compiler.state_shardings(mesh)
    batch_shardings = compiler.batch_shardings(mesh)
    compiled = compiler.get(mesh)

    def place(tree: Any, where: Any) -> Any:
        def one(sharding: Any, subtree: Any) -> Any:
            return jax.tree.map(
                lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx: np.asarray(x)[idx]),
                subtree,
            )

        return jax.tree.map(one, where, tree)

    note("ready")
    if args.mode == "orbax":
        saver: Any = OrbaxSaver(args, template, shardings, mesh, note)
    else:
        saver = OursSaver(args, template, shardings, mesh)
    step, state = saver.start(lambda: place(template, shardings))
    while step < STEPS:
        batch = place(job.data.batch(step), batch_shardings)  # the data position is the step
        state, _metrics = compiled(state, batch)
        jax.block_until_ready(state)
        step += 1
        computed = time.monotonic()
        if (
            args.process_id == args.lost
            and args.kill_at
            and step >= args.kill_at
            and saver.durable_done(args.kill_at - EVERY)
        ):
            note("kill", step=step)
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9, before this step's save, as ours is killed
        started = time.perf_counter()
        saved = saver.save(step, state)
        note("step", step=step, computed=computed, save_s=time.perf_counter() - started, saved=saved)
    saver.close()
    note("finished", step=step)
    log.close()
    jax.distributed.shutdown()


class OrbaxSaver:
    """Orbax's emergency CheckpointManager: local every step, persistent every ``EVERY`` steps, async."""

    def __init__(self, args: argparse.Namespace, template: Any, shardings: Any, mesh: Any, note: Any) -> None:
        import jax
        from orbax.checkpoint.experimental.emergency import checkpoint_manager as emergency

        from elastic_runtime.storage.boxes import per_leaf

        self.note = note
        self.persistent = Path(args.persistent_dir)
        leaves = jax.tree.leaves(per_leaf(shardings, template))
        flat, structure = jax.tree.flatten(template)
        self.abstract = jax.tree.unflatten(
            structure, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(flat, leaves, strict=True)]
        )
        options = emergency.CheckpointManagerOptions(
            local=emergency.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=2),
            persistent=emergency.PersistentCheckpointOptions(save_interval_steps=EVERY),
            enable_async_checkpointing=True,
        )
        started = time.monotonic()
        # What Orbax's own emergency benchmark does first (orbax/checkpoint/_src/testing/benchmarks/
        # emergency_checkpoint_manager_benchmark.py); a local save fails without it (process metadata).
        from orbax.checkpoint._src.multihost import multihost

        multihost.initialize_runtime_to_distributed_ids()
        multihost.initialize_distributed_to_device_ids()
        self.manager = emergency.CheckpointManager(
            local_directory=args.local_dir,
            persistent_directory=args.persistent_dir,
            global_mesh=mesh,
            abstract_state=self.abstract,
            options=options,
        )
        note("manager", seconds=time.monotonic() - started, kind=type(self.manager._checkpoint_manager).__name__)

    def start(self, fresh: Any) -> tuple[int, Any]:
        started = time.monotonic()
        latest = self.manager.latest_step()
        latest = None if latest is None else int(latest)  # np.int32 from the multi-replica manager
        if latest is None:
            return 0, fresh()
        restored = self.manager.restore(latest)
        import jax

        jax.block_until_ready(restored.state)
        self.note("restored", step=latest, seconds=time.monotonic() - started)
        return latest, restored.state

    def durable_done(self, step: int) -> bool:
        return (self.persistent / str(step)).is_dir()

    def save(self, step: int, state: Any) -> bool:
        from orbax.checkpoint import args as ocp_args

        return bool(self.manager.save(step, args=ocp_args.Composite(state=ocp_args.PyTreeSave(state))))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class OursSaver:
    """What our worker's loop does per committed step (``elastic_runtime.cluster.worker.training.train``), timed: the
    local copy of this process's boxes, the replica handed to :class:`ReplicaFiles`, and every ``EVERY`` steps the
    durable part handed to its thread (skipped while the previous one runs, as
    ``elastic_runtime.cluster.worker.durable.save_durable``)."""

    def __init__(self, args: argparse.Namespace, template: Any, shardings: Any, mesh: Any) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        from elastic_runtime.storage.replicas import ReplicaFiles, run_identity
        from elastic_runtime.storage.sharded import ShardedStore, writes

        self.process_id = args.process_id
        self.slice_size = PROCESSES // args.slices
        self.template, self.shardings = template, shardings
        self.replicas = ReplicaFiles(args.local_dir, f"worker-{args.process_id}")
        self.store = ShardedStore(args.persistent_dir)
        self.owned = writes(template, shardings, self.slice_size)
        self.identity = run_identity("bench", template, STEPS) | {"layout": f"position {args.process_id}"}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="durable")
        self.pending: Future[Any] | None = None

    def start(self, fresh: Any) -> tuple[int, Any]:
        return 0, fresh()

    def durable_done(self, step: int) -> bool:
        return True

    def save(self, step: int, state: Any) -> bool:
        from elastic_runtime.storage.boxes import local_copy
        from elastic_runtime.storage.replicas import replica

        snapshot = replica(step, step, local_copy(state), self.identity, generation=1)
        self.replicas.save(snapshot)
        due = step % EVERY == 0 and self.process_id < self.slice_size
        if due and (self.pending is None or self.pending.done()):
            self.replicas.pin(step)
            owned, lead, store = self.owned, self.process_id == 0, self.store
            tree, template, shardings = snapshot.tree, self.template, self.shardings
            self.pending = self.pool.submit(
                lambda: store.write(step, tree, template, shardings, owned=owned, lead=lead)
            )
        return due

    def close(self) -> None:
        self.replicas.wait()
        self.replicas.close()
        if self.pending is not None:
            self.pending.result()
        self.pool.shutdown()


# --- the harness groups (this file, parent side) ------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class Group:
    """4 harness workers of one mode, started together; killed together on any failure or timeout."""

    def __init__(
        self, root: Path, name: str, *, mode: str, size: int, slices: int, kill_at: int = 0, lost: int = LOST
    ) -> None:
        self.root, self.name = root, name
        self.procs: list[subprocess.Popen[bytes]] = []
        port = free_port()
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        for pid in range(PROCESSES):
            local_dir(root, pid).mkdir(parents=True, exist_ok=True)  # Orbax wants it made (empty on a new host)
            command = [
                sys.executable,
                __file__,
                "--worker",
                f"--mode={mode}",
                f"--process-id={pid}",
                f"--port={port}",
                f"--size={size}",
                f"--slices={slices}",
                f"--kill-at={kill_at}",
                f"--lost={lost}",
                f"--local-dir={local_dir(root, pid)}",
                f"--persistent-dir={root / 'persistent'}",
                f"--compile-cache={root.parent / 'xla-cache'}",
                f"--log={root / f'{name}-p{pid}.jsonl'}",
            ]
            with open(root / f"{name}-p{pid}.stderr", "wb") as err:
                self.procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env))

    def wait(self, *, for_pid: int | None = None, timeout: float = RUN_TIMEOUT_S) -> None:
        """Until every process (or ``for_pid``) has exited; raises RuntimeError on a timeout or a failure."""
        deadline = time.monotonic() + timeout
        watched = self.procs if for_pid is None else [self.procs[for_pid]]
        while [p.poll() for p in self.procs] and any(p.returncode is None for p in watched):
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name}: timed out after {timeout} s (logs in {self.root})")
            failed = [i for i, p in enumerate(self.procs) if p.returncode not in (None, 0) and i != for_pid]
            if failed and for_pid is None:
                self.kill()
                raise RuntimeError(f"{self.name}: process {failed} failed (see {self.root}/{self.name}-p*.stderr)")
            time.sleep(0.005)
        if for_pid is None and any(p.returncode != 0 for p in self.procs):
            raise RuntimeError(f"{self.name}: exit codes {[p.returncode for p in self.procs]} (see {self.root})")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def logs(self) -> list[list[dict[str, Any]]]:
        return [read_log(self.root / f"{self.name}-p{pid}.jsonl") for pid in range(PROCESSES)]


def local_dir(root: Path, pid: int) -> Path:
    return Path("/dev/shm") / f"{root.parent.name}-{root.name}" / f"p{pid}"


def step_dirs(folder: Path) -> list[Path]:
    """The step folders of one tier's folder (Orbax's ``N``, ours ``step_N``), committed ones only."""
    return [p for p in folder.iterdir() if p.is_dir() and p.name.removeprefix("step_").isdigit()]


def blocking(logs: list[list[dict[str, Any]]], *, durable_only: bool = False) -> dict[str, float]:
    """Save-call time per process over its steps (or over the steps due for the persistent/durable tier): the
    median and the mean (the cost per step, amortized over the steps that save little or nothing), each then
    the median over the processes; and the largest per-process median."""
    medians, means = [], []
    for events in logs:
        times = [e["save_s"] for e in events if e["ev"] == "step" and (e["step"] % EVERY == 0 or not durable_only)]
        if times:
            medians.append(statistics.median(times))
            means.append(statistics.fmean(times))
    if not medians:
        return {}
    return {
        "median_s": round(statistics.median(medians), 5),
        "mean_s": round(statistics.median(means), 5),
        "max_process_s": round(max(medians), 5),
    }


def case_orbax(root: Path, size: int, slices: int, lost: int = LOST) -> dict[str, Any]:
    root.mkdir(parents=True)
    name = f"orbax_{slices}slice"
    try:
        first = Group(root, f"{name}-first", mode="orbax", size=size, slices=slices, kill_at=KILL_AT, lost=lost)
        try:
            first.wait(for_pid=lost)
            if first.procs[lost].returncode != -signal.SIGKILL:
                raise RuntimeError(f"{name}: process {lost} exited with {first.procs[lost].returncode}, see {root}")
        finally:
            first.kill()  # restart on loss: every process goes, as a JobSet restarts every pod
        before = first.logs()
        killed = next(e for e in before[lost] if e["ev"] == "kill")
        shutil.rmtree(local_dir(root, lost), ignore_errors=True)  # its host's /dev/shm is gone with it
        again = Group(root, f"{name}-again", mode="orbax", size=size, slices=slices)
        try:
            again.wait()
        finally:
            again.kill()
        after = again.logs()
        restored = [next(e for e in events if e["ev"] == "restored") for events in after]
        first_steps = [next(e for e in events if e["ev"] == "step") for events in after]
        committed = max(e["t"] for e in first_steps)  # every process trained it and its save call returned
        stderr = "".join((root / f"{name}-again-p{pid}.stderr").read_text(errors="replace") for pid in range(4))
        local_dirs = [local_dir(root, pid) for pid in range(PROCESSES)]
        local_steps = [d for folder in local_dirs if folder.exists() for d in step_dirs(folder)]
        local_per_step = (
            sum(dir_bytes(d) for d in local_steps) / len({d.name for d in local_steps}) if local_steps else 0.0
        )
        persistent = root / "persistent"
        persistent_steps = step_dirs(persistent)
        local_saves = _local_saves(before, slices) + _local_saves(after, slices)
        return {
            "manager": next(e["kind"] for e in after[0] if e["ev"] == "manager"),
            "kill_step": killed["step"],
            "restored_step": restored[0]["step"],
            "restored_from": "persistent"
            if slices == 1 or "finished restoring from persistent checkpoint" in stderr.lower()
            else "local",
            "restore_s": round(max(e["seconds"] for e in restored), 3),
            # From the kill, when the last process of the restarted group reached each point.
            "timeline_s": {
                point: round(max(e["t"] for events in after for e in events if e["ev"] == point) - killed["t"], 3)
                for point in ("started", "imported", "connected", "ready", "manager", "restored")
            },
            "next_step": first_steps[0]["step"],
            "next_commit_s": round(committed - killed["t"], 3),
            "blocking_save_s": blocking(before + after),
            "blocking_save_on_persistent_steps_s": blocking(before + after, durable_only=True),
            "local_bytes_per_step": int(local_per_step),
            "local_bytes_total": int(local_per_step * local_saves),
            "local_saves": local_saves,
            "persistent_bytes_per_step": dir_bytes(persistent) // max(1, len(persistent_steps)),
            "persistent_bytes_total": dir_bytes(persistent),
            "persistent_steps": sorted(int(p.name) for p in persistent_steps),
        }
    finally:
        shutil.rmtree(local_dir(root, 0).parent, ignore_errors=True)


def _local_saves(logs: list[list[dict[str, Any]]], slices: int) -> int:
    """Local saves made: with 2 replicas, every step the non-primary replica's processes saved (local every
    step; ``save`` returns the group's "saved", True on every step then); with one, none (Orbax keeps no local
    tier)."""
    if slices == 1:
        return 0
    return sum(1 for e in logs[-1] if e["ev"] == "step" and e["saved"])


def case_ours_blocking(root: Path, size: int) -> dict[str, Any]:
    root.mkdir(parents=True)
    try:
        group = Group(root, "ours_blocking", mode="ours", size=size, slices=1)
        try:
            group.wait()
        finally:
            group.kill()
        logs = group.logs()
        return {
            "blocking_save_s": blocking(logs),
            "blocking_save_on_durable_steps_s": blocking(logs, durable_only=True),
        }
    finally:
        shutil.rmtree(local_dir(root, 0).parent, ignore_errors=True)


def case_ours(root: Path, size: int) -> dict[str, Any]:
    """Our runtime, as ``bench_slices.case_gcs`` (in place) but with the durable tier a local-disk folder."""
    from bench_slices import controller, first_commit_after, kill_time

    from elastic_runtime.cli.demo_multiprocess import wipe_lost_replicas
    from elastic_runtime.core.eventlog import read_events
    from elastic_runtime.core.events import CheckpointCommitted, StepCompleted

    run_dir, durable, replicas = root / "run", root / "durable", Path(f"/dev/shm/{root.parent.name}-{root.name}")
    try:
        ctl = controller(
            run_dir,
            size,
            processes=PROCESSES,
            slices=1,
            faults=[],
            replica_dir=str(replicas),
            durable_dir=str(durable),
            durable_every=EVERY,
        )
        wipe_lost_replicas(ctl)
        state = {"step": 0, "durable": 0, "done": False}

        async def kill_when_due(event: StepCompleted | CheckpointCommitted, ctx: Any) -> None:
            # At step 15 once durable step 10 is committed, as the Orbax runs: the same step to roll back to.
            key = "step" if isinstance(event, StepCompleted) else "durable"
            state[key] = max(state[key], event.step or 0)
            if not state["done"] and state["step"] >= KILL_AT and state["durable"] >= KILL_AT - EVERY:
                state["done"] = True
                ctx.signal(ctx.members[LOST], "KILL", "benchmark: its host is lost")

        ctl.bus.subscribe(StepCompleted, kill_when_due)
        ctl.bus.subscribe(CheckpointCommitted, kill_when_due)
        result = ctl.run()
        killed = kill_time(result.events_path)
        at, step = first_commit_after(result.events_path, killed)
        events = read_events(result.events_path)
        commits = [e for e in events if isinstance(e, CheckpointCommitted) and e.path.startswith(str(durable))]
        trained = sum(1 for e in events if isinstance(e, StepCompleted) and e.duration_s > 0)
        replica_steps = [d for folder in replicas.iterdir() if folder.is_dir() for d in step_dirs(folder)]
        per_process = sum(dir_bytes(d) for d in replica_steps) / max(1, len(replica_steps))
        durable_steps = step_dirs(durable)
        durable_per_step = dir_bytes(durable) // max(1, len(durable_steps))
        recovery = result.recoveries[0]
        return {
            "ok": result.ok,
            "restored_step": step - 1,
            "restored_from": recovery["restored_from"],
            "bytes_by_tier": recovery["bytes_by_tier"],
            "next_step": step,
            "next_commit_s": round(at - killed, 3),
            "shm_bytes_per_step": int(per_process * PROCESSES),
            "shm_bytes_total": int(per_process * PROCESSES * trained),
            "durable_bytes_per_step": durable_per_step,
            "durable_bytes_total": durable_per_step * len(commits),
            "durable_steps": sorted(e.step or 0 for e in commits),
        }
    finally:
        shutil.rmtree(replicas, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=float, default=32.0, help="state size in MB (default 32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument(
        "--cases",
        default="orbax_1slice,orbax_2slice,ours,ours_blocking",
        help="also: orbax_2slice_lost0 (process 0 lost: Orbax restores from the other replica's local tier)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("mode", "local-dir", "persistent-dir", "compile-cache", "log"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    for name in ("process-id", "port", "size", "slices", "kill-at"):
        parser.add_argument(f"--{name}", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lost", type=int, default=LOST, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        try:
            worker_main(args)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)  # not Python's exit: JAX's shutdown would wait at a barrier for peers that may be gone
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the cleanup below runs
    from bench_slices import size_for

    size = size_for(args.mb)
    state_bytes = 8 * (size * size + 2 * size)
    root = Path(tempfile.mkdtemp(prefix="bench-orbax-"))
    cases = args.cases.split(",")
    print(
        f"state {state_bytes / 2**20:.1f} MB (features = hidden = {size}), {args.repeats} repeats, in {root}",
        file=sys.stderr,
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    started = time.time()
    try:
        for repeat in range(args.repeats):
            for name in cases:
                scratch = root / f"r{repeat}-{name}"
                if name == "orbax_1slice":
                    outcome = case_orbax(scratch, size, 1)
                elif name == "orbax_2slice":
                    outcome = case_orbax(scratch, size, 2)
                elif name == "orbax_2slice_lost0":  # a process of the primary replica: the other's local is whole
                    outcome = case_orbax(scratch, size, 2, lost=0)
                elif name == "ours":
                    outcome = case_ours(scratch, size)
                else:
                    outcome = case_ours_blocking(scratch, size)
                runs[name].append(outcome)
                print(name, json.dumps(outcome), file=sys.stderr)
    finally:
        for leftover in Path("/dev/shm").glob(f"{root.name}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "state_mb": round(state_bytes / 2**20, 1),
        "minutes": round((time.time() - started) / 60, 1),
        "medians": medians(runs),
        "runs": runs,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    shutil.rmtree(root, ignore_errors=True)


def medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per case, the median of every numeric figure over the repeats; and the ratios of Orbax's to ours."""
    out: dict[str, Any] = {}
    for name, results in runs.items():
        figures: dict[str, Any] = {}
        for key in results[0] if results else []:
            values = [r[key] for r in results]
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                figures[key] = round(statistics.median(values), 4)
            elif all(isinstance(v, dict) and "median_s" in v for v in values):
                figures[key] = round(statistics.median(v["median_s"] for v in values), 5)
                figures[key.removesuffix("_s") + "_mean_s"] = round(statistics.median(v["mean_s"] for v in values), 5)
        out[name] = figures
    ours = out.get("ours", {}).get("next_commit_s")
    mine = out.get("ours_blocking", {}).get("blocking_save_mean_s")
    for name in ("orbax_1slice", "orbax_2slice", "orbax_2slice_lost0"):
        if name in out and ours:
            out[name]["next_commit_over_ours"] = round(out[name]["next_commit_s"] / ours, 2)
        if name in out and mine:
            out[name]["blocking_save_mean_over_ours"] = round(out[name]["blocking_save_mean_s"] / mine, 2)
    return out


if __name__ == "__main__":
    main()
