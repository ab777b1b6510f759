"""The snapshot and durable tiers at size on one accelerator: what a RAM snapshot makes the step wait for with a
state of 1 GB and 8 GB, every step and at the Young-Daly cadence, and a disk commit's bandwidth. A part of
tests/benchmarks/gpu_campaign.sh; not collected by pytest.

    python3 tests/benchmarks/gpu_tiers.py [--mb 1024 8192] [--steps 50] [--warmup 10] [--mtbf-s 60]
        [--disk-repeats 2] [--dir DIR] [--deadline-s 80]

Per size, a job whose state is ``--mb`` MiB of float32 (16 arrays, made on the device under ``jit``) and whose step
reads and writes all of it (an elementwise update: memory-bound, the shortest step a state of that size has, so
the copy's share is the largest it can be):

- ``bare``: a plain loop around the compiled step;
- ``runtime_off``: ``ElasticRuntime``, snapshots and disk off;
- ``runtime_every_step``: a RAM snapshot every step (the copy to pinned host memory compiled into the step);
- ``runtime_young_daly``: snapshots at the Young-Daly interval for an MTBF of ``--mtbf-s`` (``snapshot_mtbf_s``:
  the cadence is measured as the run goes; the snapshots taken in the measured steps are counted);

each's mean and median step after ``--warmup`` (the runtime's: between committed steps), and ``blocking_ms``, the
mean step over ``runtime_off``'s: what the snapshots add to a step, averaged over the steps. Then the disk: the
state captured to host memory (``RamTier.capture``, as bench_checkpoint.py: its blocking time and the copy's time
in the background) and committed with ``DiskTier.save`` (Orbax's layout, CRC32C, manifest, everything fsynced):
state bytes over that time, against a raw write of the same bytes to one file with one fsync, in the same folder.

A size is skipped where memory does not allow it: less than 3x its state free on the device or 4x available on
the host (the state, the step's new state; two pinned snapshot buffers and the assembled copy on the host). The last
line printed is JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax
import jax.numpy as jnp
import numpy as np
from bench_checkpoint import save_to_ram  # our save, as bench_checkpoint.py times it: blocking, then the copy
from gpu_common import Deadline, Model, bare_loop, emit, machine, ms, runtime_loop
from jax.sharding import PartitionSpec as P

from elastic_runtime import MeshPolicy, TrainJob
from elastic_runtime.core.compiler import shardings_for
from elastic_runtime.core.initial import initial_program
from elastic_runtime.core.snapshot import RamTier
from elastic_runtime.storage.disk import DiskTier

COLS, LEAVES = 1024, 16
OFF = {"snapshot_every": 0, "precompile": False, "scale_up_poll_s": None, "checkpoint_dir": ""}


class ConstantBatches:
    """A small batch per position (the state's size is the point, not the data's)."""

    def __init__(self, global_batch: int) -> None:
        self.global_batch = global_batch

    def batch(self, position: int) -> dict[str, np.ndarray]:
        return {"x": np.full((self.global_batch, 8), position % 13, np.float32)}


def sized_job(mib: int, global_batch: int) -> TrainJob:
    rows = max(1, mib * 2**20 // 4 // COLS // LEAVES)

    def init() -> dict[str, jax.Array]:
        # JAX operations: made on the device under jit, never whole on the host.
        keys = jax.random.split(jax.random.key(0), LEAVES)
        return {f"w{i:02d}": jax.random.normal(keys[i], (rows, COLS), jnp.float32) for i in range(LEAVES)}

    def step(state: dict[str, jax.Array], batch: dict[str, jax.Array]) -> tuple[Any, dict[str, jax.Array]]:
        g = jnp.mean(batch["x"]) * 1e-4
        return {k: v * (1 - 1e-4) + g for k, v in state.items()}, {"loss": g}

    return TrainJob(init=init, step=step, data=ConstantBatches(global_batch), state_specs=P(), batch_spec=P("data"))


def sized_model(mib: int) -> Model:
    global_batch = len(jax.devices())  # one row per device: the batch is not what this measures
    job = sized_job(mib, global_batch)
    policy = MeshPolicy({"data": 1 if jax.devices()[0].platform == "cpu" else global_batch}, global_batch=global_batch)
    rows = max(1, mib * 2**20 // 4 // COLS // LEAVES)
    return Model("sized", f"{mib}MiB", job, policy, round(rows * COLS * 4 * LEAVES / 1e6, 2))


def memory_allows(state_bytes: float) -> str | None:
    """Why a state of ``state_bytes`` does not fit here (None: it does)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if free < 3 * state_bytes:
            return f"device memory: {free / 1e9:.1f} GB free, 3x the state needs {3 * state_bytes / 1e9:.1f} GB"
    available = host_available()
    if available is not None and available < 4 * state_bytes:
        return f"host memory: {available / 1e9:.1f} GB available, 4x the state needs {4 * state_bytes / 1e9:.1f} GB"
    return None


def host_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def fs_type(directory: Path) -> str:
    """The file system ``directory`` is on (the longest mount point above it), e.g. ``ext4`` or ``tmpfs``."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fs, *_ = line.split()
            if str(directory.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fs
    except OSError:
        pass
    return kind


def raw_write(directory: Path, tree: Any) -> float:
    """Seconds to write every leaf of ``tree`` to one file, in 64 MiB writes, and fsync it."""
    path = directory / "raw.bin"
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for leaf in jax.tree.leaves(tree):
            view = memoryview(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8).data)
            for at in range(0, len(view), 64 << 20):
                f.write(view[at : at + (64 << 20)])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def disk_commit(model: Model, directory: Path, repeats: int, deadline: Deadline) -> dict[str, Any]:
    mesh = model.policy.fit(jax.devices())
    state = initial_program(model.job, shardings_for(model.job.state_specs, mesh), mesh)()
    ram, disk = RamTier(), DiskTier(directory / "ours")
    results: dict[str, list[float]] = {"ours_block_s": [], "ours_copy_s": [], "commit_s": [], "raw_s": []}
    nbytes = 0
    try:
        for r in range(1, repeats + 1):
            if r > 1 and not deadline.allows(1.5 * (results["commit_s"][-1] + results["raw_s"][-1])):
                break
            snapshot = save_to_ram(ram, state, r, results)
            nbytes = snapshot.nbytes
            started = time.perf_counter()
            disk.save(snapshot, timeout=600)
            results["commit_s"].append(time.perf_counter() - started)
            results["raw_s"].append(raw_write(directory, snapshot.tree))
            del snapshot
            for info in disk.list(timeout=60):
                disk.delete(info.step, timeout=60)
    finally:
        ram.close()
    med = {k: float(np.median(v)) for k, v in results.items()}
    return {
        "repeats": len(results["commit_s"]),
        "bytes": nbytes,
        "capture_blocking_ms": round(med["ours_block_s"] * 1e3, 3),
        "host_copy_ms_in_background": round(med["ours_copy_s"] * 1e3, 1),
        "commit_gb_per_s": round(nbytes / 1e9 / med["commit_s"], 3),
        "raw_write_gb_per_s": round(nbytes / 1e9 / med["raw_s"], 3),
        "commit_to_raw": round(med["raw_s"] / med["commit_s"], 3),
    }


def one_size(
    mib: int, *, steps: int, warmup: int, mtbf_s: float, disk_repeats: int, directory: Path, deadline: Deadline
) -> dict[str, Any]:
    model = sized_model(mib)
    why_not = memory_allows(model.state_mb * 1e6)
    if why_not:
        return {"skipped": why_not, "state_mb": model.state_mb}
    runs: dict[str, dict[str, Any]] = {}
    variants: dict[str, dict[str, Any]] = {
        "runtime_off": OFF,
        "runtime_every_step": {**OFF, "snapshot_every": 1},
        "runtime_young_daly": {**OFF, "snapshot_every": 1, "snapshot_mtbf_s": mtbf_s},
    }
    longest = 0.0
    started = time.monotonic()
    runs["bare"] = {"times": bare_loop(model, steps=steps, warmup=warmup), "snapshots": 0}
    longest = time.monotonic() - started
    for name, options in variants.items():
        if not deadline.allows(2 * longest):
            break
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="gpu-tiers-", dir=directory) as run_dir:
            runs[name] = runtime_loop(model, steps=steps, warmup=warmup, run_dir=run_dir, **options)
        longest = max(longest, time.monotonic() - started)
    contenders = {name: {**ms(run["times"]), "snapshots": run["snapshots"]} for name, run in runs.items()}
    off = contenders.get("runtime_off", {}).get("mean_ms")
    for row in contenders.values():
        row["blocking_ms"] = None if off is None else round(row["mean_ms"] - off, 3)
    result: dict[str, Any] = {"state_mb": model.state_mb, "contenders": contenders}
    if deadline.allows(2 * longest):
        result["disk"] = disk_commit(model, directory, disk_repeats, deadline)
    else:
        result["disk"] = {"skipped": "the part's time budget ran out before the disk commit"}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[1024, 8192], help="state sizes in MiB")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--mtbf-s", type=float, default=60.0, help="the MTBF the Young-Daly cadence plans for")
    parser.add_argument("--disk-repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: the temp folder)")
    parser.add_argument("--deadline-s", type=float, default=None, help="start nothing that would end after this")
    args = parser.parse_args()
    deadline = Deadline(args.deadline_s)
    base = Path(args.dir or tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="gpu-tiers-", dir=base))
    sizes: dict[str, Any] = {}
    try:
        for mib in args.mb:
            if not deadline.allows(10.0):
                sizes[f"{mib}MiB"] = {"skipped": "the part's time budget ran out before this size"}
                continue
            sizes[f"{mib}MiB"] = one_size(
                mib,
                steps=args.steps,
                warmup=args.warmup,
                mtbf_s=args.mtbf_s,
                disk_repeats=args.disk_repeats,
                directory=directory,
                deadline=deadline,
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    emit(
        {
            "machine": machine(),
            "directory_fs": fs_type(base),
            "steps": args.steps,
            "warmup": args.warmup,
            "mtbf_s": args.mtbf_s,
            "sizes": sizes,
            "load_average": os.getloadavg(),
        }
    )


if __name__ == "__main__":
    main()
