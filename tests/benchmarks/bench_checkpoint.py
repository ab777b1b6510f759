"""Checkpointing, side by side in one run on the same 256 MiB state: our tiers against Orbax and the raw disk.

Blocking time per save is what training waits for. Ours: RamTier.capture, which hands the state to a thread
that runs the compiled copy into pinned_host memory; the disk write then runs from that host copy in the
background. The host copy's time counts both the copy and its assembly into numpy arrays, which the disk
tier needs (the disk thread does it, off the training thread). Orbax: an async CheckpointManager.save with
StandardSave, which returns after its own device-to-host copy.

Disk commit throughput is state bytes over the time of DiskTier.save from the host snapshot: the arrays in
Orbax's layout, the CRC32C of every file, the manifest, everything fsynced. It is compared with the raw
sequential write bandwidth of the same directory in the same run: one file, one write, one fsync. The disk
tier writes one file per array and fsyncs them concurrently, which keeps more I/O in flight than the single
raw stream, so on a virtio disk it can come out above 100%: read that as "at disk speed".

Restore time per tier is measured onto the 8 devices (device_put, block_until_ready): RAM (the held host copy),
the /dev/shm mirror and the disk (both read and CRC32C-check every byte), and plain Orbax
(CheckpointManager.restore of the checkpoint Orbax wrote, straight into sharded arrays). The page cache is warm
for every reader alike. Each repeat interleaves the contenders, so that load from other processes hits all of
them; figures are medians.

    .venv/bin/python tests/benchmarks/bench_checkpoint.py [--mb 256] [--repeats 5] [--dir DIR] [--json]
    (not collected by pytest; --json prints one JSON object on the last line, for run_all.py)

With ``--blocking-only`` it measures the blocking time and the host copy against Orbax's async save and
nothing else: the check for an accelerator with a state of several GB, where the disk and restore figures
would only measure that machine's disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from elastic_runtime.core.snapshot import HostSnapshot, RamTier  # noqa: E402
from elastic_runtime.storage.disk import DiskTier  # noqa: E402


def make_state(megabytes: int, leaves: int = 16) -> tuple[dict[str, jax.Array], dict[str, NamedSharding]]:
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices, ("data",))
    sharding = NamedSharding(mesh, P("data"))
    cols = 1024
    rows = megabytes * (1 << 20) // 4 // cols // leaves // 8 * 8
    rng = np.random.default_rng(0)
    state = {}
    for i in range(leaves):
        host = rng.standard_normal((rows, cols), dtype=np.float32)
        state[f"layer{i:02d}"] = jax.device_put(host, sharding)
    jax.block_until_ready(state)
    return state, {k: sharding for k in state}


def nbytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def raw_write(directory: Path, data: np.ndarray) -> float:
    path = directory / "raw.bin"
    view = memoryview(data.reshape(-1).view(np.uint8).data)
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for at in range(0, len(view), 64 << 20):
            f.write(view[at : at + (64 << 20)])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def machine() -> str:
    device = jax.devices()[0]
    return (
        f"{len(jax.devices())} x {device.device_kind} ({device.platform}), {platform.machine()}, {os.cpu_count()} "
        f"CPUs, Python {platform.python_version()}, jax {jax.__version__}, orbax-checkpoint {ocp.__version__}"
    )


def run_blocking(megabytes: int, repeats: int, directory: Path) -> dict[str, Any]:
    """Blocking time per save, ours against Orbax async, and our host copy's time in the background."""
    state, _ = make_state(megabytes)
    ram = RamTier()
    manager = ocp.CheckpointManager(
        directory / "orbax", options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=1)
    )
    results: dict[str, list[float]] = {"ours_block_s": [], "ours_copy_s": [], "orbax_block_s": []}
    try:
        for r in range(1, repeats + 1):
            save_to_ram(ram, state, r, results)
            save_with_orbax(manager, state, r, results)
    finally:
        manager.close()
        ram.close()
    med = {k: median(v) for k, v in results.items()}
    return {
        "machine": machine(),
        "state_mib": round(nbytes(state) / 2**20),
        "repeats": repeats,
        "blocking_ms_ours": round(med["ours_block_s"] * 1000, 2),
        "blocking_ms_orbax_async": round(med["orbax_block_s"] * 1000, 2),
        "blocking_ratio_ours_to_orbax": round(med["ours_block_s"] / med["orbax_block_s"], 4),
        "host_copy_ms_ours_in_background": round(med["ours_copy_s"] * 1000, 1),
        "all_ms": {k: [round(x * 1000, 2) for x in v] for k, v in results.items()},
    }


def save_to_ram(ram: RamTier, state: Any, step: int, results: dict[str, list[float]]) -> HostSnapshot:
    """Our save: records its blocking time (``ours_block_s``) and the host copy's time in the background
    (``ours_copy_s``), including the assembly into numpy that the disk thread would do."""
    started = time.perf_counter()
    ram.capture(state, step=step, data_position=step, metadata={})
    results["ours_block_s"].append(time.perf_counter() - started)
    snapshot = ram.latest(None, timeout=600)
    assembling = time.perf_counter()
    snapshot.tree  # noqa: B018  assembled into numpy here: part of the host copy
    results["ours_copy_s"].append(snapshot.seconds + time.perf_counter() - assembling)
    return snapshot


def save_with_orbax(manager: ocp.CheckpointManager, state: Any, step: int, results: dict[str, list[float]]) -> float:
    """Orbax's async save: records its blocking time (``orbax_block_s``), waits for it to finish and returns
    when it started."""
    started = time.perf_counter()
    manager.save(step, args=ocp.args.StandardSave(state))
    results["orbax_block_s"].append(time.perf_counter() - started)
    manager.wait_until_finished()
    return started


def run(megabytes: int, repeats: int, directory: Path) -> dict[str, Any]:
    state, shardings = make_state(megabytes)
    size = nbytes(state)
    flat = np.concatenate([np.asarray(x).reshape(-1) for x in jax.tree.leaves(state)])
    results: dict[str, list[float]] = {
        k: []
        for k in (
            "raw_write_s",
            "ours_block_s",
            "ours_copy_s",
            "ours_disk_commit_s",
            "orbax_block_s",
            "orbax_commit_s",
            "restore_ram_s",
            "restore_shm_s",
            "restore_disk_s",
            "restore_orbax_s",
        )
    }

    ram = RamTier()
    disk = DiskTier(directory / "ours")
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else directory
    shm = DiskTier(Path(tempfile.mkdtemp(prefix="bench-shm-", dir=shm_root)), name="shm")
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=2)
    manager = ocp.CheckpointManager(directory / "orbax", options=options)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    try:
        for r in range(1, repeats + 1):
            # Interleaved, so that load from other processes on the machine hits every contender alike.
            results["raw_write_s"].append(raw_write(directory, flat))

            snapshot = save_to_ram(ram, state, r, results)
            started = time.perf_counter()
            disk.save(snapshot, timeout=600)
            results["ours_disk_commit_s"].append(time.perf_counter() - started)
            shm.save(snapshot, timeout=600)
            for old in [i.step for i in disk.list(timeout=60)][2:]:
                disk.delete(old, timeout=60)
            for old in [i.step for i in shm.list(timeout=60)][2:]:
                shm.delete(old, timeout=60)

            started = save_with_orbax(manager, state, r, results)
            results["orbax_commit_s"].append(time.perf_counter() - started)

            started = time.perf_counter()
            held = ram.latest(None, timeout=60)
            jax.block_until_ready(jax.device_put(held.tree, shardings))
            results["restore_ram_s"].append(time.perf_counter() - started)

            started = time.perf_counter()
            jax.block_until_ready(jax.device_put(shm.restore(r, state, timeout=600).tree, shardings))
            results["restore_shm_s"].append(time.perf_counter() - started)

            started = time.perf_counter()
            jax.block_until_ready(jax.device_put(disk.restore(r, state, timeout=600).tree, shardings))
            results["restore_disk_s"].append(time.perf_counter() - started)

            started = time.perf_counter()
            restored = manager.restore(r, args=ocp.args.StandardRestore(abstract))
            jax.block_until_ready(restored)
            results["restore_orbax_s"].append(time.perf_counter() - started)
            del restored
    finally:
        manager.close()
        ram.close()
        shutil.rmtree(shm.root, ignore_errors=True)

    med = {k: median(v) for k, v in results.items()}
    gb = size / 1e9
    return {
        "state_bytes": size,
        "repeats": repeats,
        "directory": str(directory),
        "machine": machine(),
        "load_average": os.getloadavg(),
        "median": med,
        "all": results,
        "raw_write_gbps": gb / med["raw_write_s"],
        "ours_disk_gbps": gb / med["ours_disk_commit_s"],
        "orbax_commit_gbps": gb / med["orbax_commit_s"],
        "ratio_block_ours_vs_orbax": med["ours_block_s"] / med["orbax_block_s"],
        "ratio_disk_vs_raw": med["raw_write_s"] / med["ours_disk_commit_s"],
        "ratio_restore_disk_vs_ram": med["restore_disk_s"] / med["restore_ram_s"],
        "ratio_restore_disk_vs_orbax": med["restore_disk_s"] / med["restore_orbax_s"],
    }


def markdown(report: dict[str, Any]) -> str:
    m = report["median"]
    ms = 1000.0
    rows = [
        ("blocking time per save, ours (RAM capture)", f"{m['ours_block_s'] * ms:.1f} ms"),
        ("host copy finished in the background, ours (not blocking)", f"{m['ours_copy_s'] * ms:.1f} ms"),
        ("blocking time per save, Orbax async CheckpointManager", f"{m['orbax_block_s'] * ms:.1f} ms"),
        ("ratio ours / Orbax (goal <= 1.0)", f"{report['ratio_block_ours_vs_orbax']:.2f}x"),
        ("raw sequential write + fsync, same directory", f"{report['raw_write_gbps']:.2f} GB/s"),
        ("disk tier commit (Orbax layout, CRC32C, manifest, all fsynced)", f"{report['ours_disk_gbps']:.2f} GB/s"),
        ("disk commit / raw bandwidth (goal >= 70%)", f"{report['ratio_disk_vs_raw'] * 100:.0f}%"),
        ("Orbax async save, start to finished (reference)", f"{report['orbax_commit_gbps']:.2f} GB/s"),
        ("restore onto devices: RAM", f"{m['restore_ram_s'] * ms:.1f} ms"),
        ("restore onto devices: /dev/shm mirror", f"{m['restore_shm_s'] * ms:.1f} ms"),
        ("restore onto devices: disk (verified)", f"{m['restore_disk_s'] * ms:.1f} ms"),
        ("restore onto devices: plain Orbax", f"{m['restore_orbax_s'] * ms:.1f} ms"),
        ("disk / RAM restore (goal >= 5x)", f"{report['ratio_restore_disk_vs_ram']:.1f}x"),
        ("disk / plain Orbax restore (goal <= 1.0)", f"{report['ratio_restore_disk_vs_orbax']:.2f}x"),
    ]
    lines = ["| measure (median) | value |", "| --- | --- |"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The figures, flat, as one JSON object (what tests/benchmarks/run_all.py tabulates)."""
    m = report["median"]
    return {
        "state_mib": round(report["state_bytes"] / 2**20),
        "repeats": report["repeats"],
        "blocking_ms_ours": round(m["ours_block_s"] * 1000, 2),
        "blocking_ms_orbax_async": round(m["orbax_block_s"] * 1000, 2),
        "blocking_ratio_ours_to_orbax": round(report["ratio_block_ours_vs_orbax"], 3),
        "host_copy_ms_ours_in_background": round(m["ours_copy_s"] * 1000, 1),
        "raw_write_gb_per_s": round(report["raw_write_gbps"], 3),
        "disk_commit_gb_per_s": round(report["ours_disk_gbps"], 3),
        "disk_commit_to_raw": round(report["ratio_disk_vs_raw"], 3),
        "orbax_async_save_gb_per_s": round(report["orbax_commit_gbps"], 3),
        "restore_ms": {k: round(m[f"restore_{k}_s"] * 1000, 1) for k in ("ram", "shm", "disk", "orbax")},
        "restore_disk_to_ram": round(report["ratio_restore_disk_vs_ram"], 2),
        "restore_disk_to_orbax": round(report["ratio_restore_disk_vs_orbax"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="saves and restores per contender")
    parser.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument("--blocking-only", action="store_true", help="only blocking time and host copy vs Orbax")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=base))
    try:
        if args.blocking_only:
            print(json.dumps(run_blocking(args.mb, args.repeats, directory)))
            return
        report = run(args.mb, args.repeats, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(summary(report)))
        return
    print(f"state {report['state_bytes'] / 2**20:.0f} MiB, {report['repeats']} repeats, {report['machine']}")
    print(f"load average {report['load_average']}")
    print(markdown(report))


if __name__ == "__main__":
    main()
