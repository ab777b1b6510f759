"""A training process killed with ``kill -9`` and the run continued by a new process with ``resume=True``, from
``/dev/shm`` and from disk, against a plain restart with Orbax from disk: seconds from spawning the new process to
its first committed step, compile included, with an empty compilation cache and with the one the killed process
(or the first Orbax restart) filled. A part of tests/benchmarks/gpu_campaign.sh; not collected by pytest.

    python3 tests/benchmarks/gpu_resume.py [--model flax] [--size example] [--kill-at 30] [--disk-every 10]
        [--variants shm_warm orbax_cold orbax_warm disk_warm shm_cold disk_cold] [--deadline-s 80]

First a run of the model (``ElasticRuntime``, its mirror of every RAM snapshot in a ``/dev/shm`` folder,
``ram_dir``, and the disk tier every ``--disk-every`` steps) kills itself with SIGKILL at the first step boundary
from ``--kill-at`` on at which the disk holds a committed step and ``/dev/shm`` a newer one (what
``examples/flax_lm.py --kill-at`` does: nothing is flushed). Before training it saves its initial state with plain
Orbax (``StandardCheckpointer``) for the baseline: the same arrays as the trained state. Then, each a new process
started on a fresh copy of what the killed one left:

- ``shm_warm``: ``resume=True`` with the run folder and the ``/dev/shm`` folder as left: restores from ``/dev/shm``;
  the run folder's compilation cache (``<run_dir>/xla-cache``, the runtime's default) holds the killed run's
  programs;
- ``shm_cold``: the same, the compilation cache emptied first (a new host's first start);
- ``disk_warm``, ``disk_cold``: the ``/dev/shm`` folder emptied (the host rebooted): restores from disk;
- ``orbax_cold``: what a job without the runtime does (bench_recovery.py's restart): build the model, restore the
  state with ``StandardCheckpointer`` onto the mesh, ``jit`` the step and run it once, JAX's persistent compilation
  cache pointed at an empty folder; ``orbax_warm``: the same again, that folder now filled.

The figure is from ``Popen`` to the first committed step (the runtime's ``StepCompleted``; the Orbax restart's
first step's loss on the host), on the machine's monotonic clock, which every process shares. Each process also
says what it restored and how many XLA compiles it ran and loaded from the cache (JAX's monitoring events). This
process starts no JAX backend (the children get the whole accelerator). The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The runtime's default case and the baseline first: a budget that runs out drops the last ones. orbax_warm loads
# what orbax_cold compiled.
VARIANTS = ("shm_warm", "orbax_cold", "orbax_warm", "disk_warm", "shm_cold", "disk_cold")
CACHE_FOLDER = "xla-cache"  # elastic_runtime.core.folders.COMPILE_CACHE_FOLDER (not imported: it loads JAX)


# --- the children ---------------------------------------------------------------------------------------------


class Compiles:
    """Programs compiled and programs loaded from the persistent cache in this process (its model's eager
    initialisation included), from JAX's monitoring events."""

    def __init__(self) -> None:
        import jax

        self.requests = self.hits = 0
        jax.monitoring.register_event_duration_secs_listener(self.on_duration)
        jax.monitoring.register_event_listener(self.on_event)

    def on_duration(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":  # a compile, or a load from the cache
            self.requests += 1

    def on_event(self, event: str, **kwargs: str | int) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1

    def counts(self) -> dict[str, int]:
        return {"compiled": self.requests - self.hits, "loaded": self.hits}


def child(args: argparse.Namespace) -> None:
    """One process of the benchmark: ``train`` (killed), ``resume`` or ``orbax``; prints one JSON line."""
    sys.path.insert(0, str(HERE))
    import jax
    import orbax.checkpoint as ocp
    from gpu_common import build

    from elastic_runtime import CheckpointCommitted, ElasticRuntime, RuntimeConfig, StateRestored, StepCompleted
    from elastic_runtime.core.compiler import shardings_for
    from elastic_runtime.core.initial import initial_program
    from elastic_runtime.core.keys import with_key_data

    compiles = Compiles()
    model = build(args.model, args.size, str(Path(args.orbax).parent / "model-output"))  # MaxText writes there
    mesh = model.policy.fit(jax.devices())
    # Orbax takes arrays of numeric dtypes only: typed PRNG keys (MaxText's) as their key data, as the runtime
    # keeps them.
    job, _ = with_key_data(model.job)
    state_sharding = shardings_for(job.state_specs, mesh)

    if args.role == "orbax":
        if args.cache:
            jax.config.update("jax_compilation_cache_dir", args.cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(job.init),
            state_sharding,
        )
        state = ocp.StandardCheckpointer().restore(args.orbax, abstract)
        batch_sharding = shardings_for(job.batch_spec, mesh)
        with jax.set_mesh(mesh):
            step = jax.jit(
                job.step_on(mesh),
                in_shardings=(state_sharding, batch_sharding),
                out_shardings=(state_sharding, NamedSharding(mesh, P())),
            )
            state, metrics = step(state, jax.device_put(job.data.batch(0), batch_sharding))
        loss = float(job.loss(metrics))
        print(json.dumps({"first_commit_mono": time.monotonic(), "loss": loss, **compiles.counts()}), flush=True)
        return

    config = RuntimeConfig(run_dir=args.run_dir, ram_dir=args.ram_dir, disk_every=args.disk_every)
    runtime = ElasticRuntime(model.job, config=config, mesh_policy=model.policy)
    seen: dict[str, Any] = {}

    @runtime.on(StepCompleted)
    async def committed(event: StepCompleted, ctx: Any) -> None:
        if args.role == "resume":
            # The measure ends at the first committed step: the rest of the run, and its final checkpoint, would
            # only take the campaign's time.
            reply = {**seen, "first_commit_mono": event.mono_time, "first_step": event.step, **compiles.counts()}
            print(json.dumps(reply), flush=True)
            os._exit(0)

    @runtime.on(StateRestored)
    async def restored(event: StateRestored, ctx: Any) -> None:
        seen.update(restored_from=event.restored_from, restored_step=event.step, restore_s=round(event.seconds, 4))

    if args.role == "train":
        place = initial_program(job, state_sharding, mesh)()
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(args.orbax, place)
        checkpointer.wait_until_finished()
        del place
        newest: dict[str, int] = {}

        @runtime.on(CheckpointCommitted)
        async def tiers(event: CheckpointCommitted, ctx: Any) -> None:
            newest[event.tier] = max(newest.get(event.tier, -1), event.step or 0)

        def kill(step: int) -> None:
            on_disk = newest.get("disk", -1)
            if step >= args.kill_at and on_disk > 0 and (not args.ram_dir or newest.get("shm", -1) > on_disk):
                os.kill(os.getpid(), signal.SIGKILL)

        runtime.at_step_boundary(kill)
        runtime.run(args.kill_at + 10 * args.disk_every + 100)
        print(json.dumps({"error": "the run ended without being killed", "newest": newest}), flush=True)
        return

    runtime.run(args.kill_at + 10 * args.disk_every + 1000, resume=True)  # far beyond the killed step
    print(json.dumps({"error": "the resumed run committed no step"}), flush=True)


# --- the benchmark ---------------------------------------------------------------------------------------------


def spawn(role: str, common: list[str], *extra: str, timeout: float) -> tuple[float, dict[str, Any], int]:
    """Start a child; (when it was started on the monotonic clock, its JSON line or {}, its exit status)."""
    command = [sys.executable, str(Path(__file__).resolve()), "child", "--role", role, *common, *extra]
    # Each allocates its accelerator memory as it goes (not 75% of it at its start): one started just after the
    # killed one never waits for the driver to take back what that one held. The same for every variant.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=min(max(timeout, 1.0), 600.0))
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    reply = json.loads(lines[-1]) if lines else {}
    if done.returncode not in (0, -signal.SIGKILL) or "error" in reply:
        tail = done.stderr[-2000:]
        raise RuntimeError(f"{role} child: exit {done.returncode}, {reply.get('error', '')}\n{tail}")
    return started, reply, done.returncode


def shm_root() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def resume_benchmark(
    model: str, size: str, *, kill_at: int, disk_every: int, variants: list[str], deadline_s: float | None
) -> dict[str, Any]:
    end = None if deadline_s is None else time.monotonic() + deadline_s
    tmp = Path(tempfile.mkdtemp(prefix="gpu-resume-"))
    shm = Path(tempfile.mkdtemp(prefix="gpu-resume-", dir=shm_root()))
    orbax = tmp / "orbax"
    common = ["--model", model, "--size", size, "--disk-every", str(disk_every), "--orbax", str(orbax)]
    results: dict[str, Any] = {"model": model, "size": size, "kill_at": kill_at, "disk_every": disk_every}
    try:

        def left() -> float:
            return float("inf") if end is None else end - time.monotonic()

        # Every process runs in the same two folders: JAX's persistent cache keys a compile by its folder's path
        # too (through XLA's compile options: seen with jax 0.10 on CPU), so a resume elsewhere would compile anew.
        run_dir, ram_dir = tmp / "run", shm / "run"
        as_left, shm_as_left = tmp / "as-left", tmp / "shm-as-left"
        folders = ["--run-dir", str(run_dir), "--ram-dir", str(ram_dir)]
        started, _, status = spawn("train", common, *folders, "--kill-at", str(kill_at), timeout=left())
        if status != -signal.SIGKILL:
            raise RuntimeError(f"the training process was not killed (exit {status})")
        results["killed_after_s"] = round(time.monotonic() - started, 3)
        results["killed_at"] = last_step(run_dir / "events.jsonl")
        shutil.move(run_dir, as_left)
        shutil.move(ram_dir, shm_as_left)
        seconds: dict[str, float] = {}
        detail: dict[str, Any] = {}
        longest = 0.0
        cache = tmp / "orbax-cache"
        for variant in variants:
            if left() < 1.5 * longest + 5:
                detail[variant] = {"skipped": "the part's time budget ran out"}
                continue
            began = time.monotonic()
            try:
                if variant.startswith("orbax"):
                    started, reply, _ = spawn("orbax", common, "--cache", str(cache), timeout=left())
                else:
                    shutil.copytree(as_left, run_dir)  # what the killed process left, afresh for each variant
                    if variant.startswith("shm"):
                        shutil.copytree(shm_as_left, ram_dir)
                    else:
                        ram_dir.mkdir()  # the host rebooted: its /dev/shm is empty
                    if variant.endswith("cold"):
                        shutil.rmtree(run_dir / CACHE_FOLDER, ignore_errors=True)
                    try:
                        started, reply, _ = spawn("resume", common, *folders, timeout=left())
                    finally:
                        shutil.rmtree(run_dir, ignore_errors=True)
                        shutil.rmtree(ram_dir, ignore_errors=True)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # one variant's failure leaves the others
                detail[variant] = {"error": str(exc)[-2000:]}
                continue
            finally:
                longest = max(longest, time.monotonic() - began)
            seconds[variant] = round(reply["first_commit_mono"] - started, 3)
            detail[variant] = {k: v for k, v in reply.items() if k not in ("first_commit_mono",)}
        results["first_commit_s"] = seconds
        results["detail"] = detail
        base = seconds.get("orbax_cold")
        results["orbax_cold_over"] = {k: round(base / v, 2) for k, v in seconds.items() if base and v > 0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    results["load_average"] = os.getloadavg()
    return results


def last_step(events: Path) -> int | None:
    """The newest committed step in an event log, read as JSON (no JAX here)."""
    step = None
    for line in events.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the line a SIGKILL cut
        if event.get("type") == "StepCompleted":
            step = event.get("step")
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    kid = sub.add_parser("child", help="internal: one process of the benchmark")
    kid.add_argument("--role", choices=["train", "resume", "orbax"], required=True)
    for p in (parser, kid):
        p.add_argument("--model", choices=["flax", "maxtext"], default="flax")
        p.add_argument("--size", default="example")
        p.add_argument("--disk-every", type=int, default=10)
        p.add_argument("--kill-at", type=int, default=30)
    kid.add_argument("--orbax", required=True)
    kid.add_argument("--run-dir", default=None)
    kid.add_argument("--ram-dir", default=None)
    kid.add_argument("--cache", default=None)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--deadline-s", type=float, default=None, help="start nothing that would end after this")
    args = parser.parse_args()
    if args.command == "child":
        child(args)
        return
    result = resume_benchmark(
        args.model,
        args.size,
        kill_at=args.kill_at,
        disk_every=args.disk_every,
        variants=args.variants,
        deadline_s=args.deadline_s,
    )
    print(json.dumps(result), flush=True)
    failed = [variant for variant, detail in result["detail"].items() if "error" in detail]
    if failed:
        sys.exit(f"variants failed: {', '.join(failed)} (their errors are in the result's detail)")


if __name__ == "__main__":
    main()
