"""The ``/dev/shm`` mirror (``RuntimeConfig.ram_dir``) in the packed layout it writes (one file, no fsync)
against Orbax's layout as the disk tier writes it (two files and a directory per array, fsynced), with the
flax example's state (91 arrays, 5.4 MB):

- one save through ``DiskTier.save`` into ``/dev/shm``, alternating, on an idle machine and while the
  example's training step runs back to back in another thread;
- in a run: the example trains ``--steps`` steps with the mirror on, once per layout (the Orbax layout is
  the mirror as it was before the packed one), and the figures are the mirrored snapshots committed and
  skipped (a snapshot that comes due while the mirror still writes the previous one is skipped) and how far
  the newest mirrored step trailed each committed step (what a process crash would lose).

    .venv/bin/python tests/benchmarks/bench_shm_mirror.py [--repeats 20] [--steps 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from elastic_runtime.core.snapshot import HostSnapshot  # noqa: E402
from elastic_runtime.storage.disk import DiskTier  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flax_lm.py"
sys.path.insert(0, str(EXAMPLE.parent))
import flax_lm  # noqa: E402  (examples/flax_lm.py)


def train_until(stop: threading.Event, job: Any) -> None:
    step = jax.jit(job.step)
    state, batch = job.init(), job.data.batch(0)
    while not stop.is_set():
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)


def measure(tiers: dict[str, DiskTier], tree: Any, repeats: int) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {name: [] for name in tiers}
    for i in range(repeats):
        for name, tier in tiers.items():
            snapshot = HostSnapshot(step=i + 1, data_position=i + 1, tree=tree, nbytes=0, seconds=0.0, metadata={})
            started = time.perf_counter()
            tier.save(snapshot, timeout=120)
            seconds[name].append(time.perf_counter() - started)
            tier.delete(i + 1, timeout=120)
    return seconds


def in_a_run(job: Any, steps: int, *, packed: bool) -> dict[str, float]:
    """Train with the mirror on; the mirror's tier in the layout asked for."""
    import elastic_runtime.storage.cascade
    from elastic_runtime import (
        CheckpointCommitted,
        CheckpointSkipped,
        ElasticRuntime,
        MeshPolicy,
        RuntimeConfig,
        StepCompleted,
        read_events,
    )

    def mirror_tier(root: str, *, name: str, **_: Any) -> DiskTier:
        return DiskTier(root, name=name, packed=packed, sync=not packed)

    real = elastic_runtime.storage.cascade.DiskTier
    elastic_runtime.storage.cascade.DiskTier = mirror_tier  # type: ignore[assignment, misc]  # the one tier built with ram_dir
    try:
        with tempfile.TemporaryDirectory() as run_dir, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
            config = RuntimeConfig(run_dir=run_dir, ram_dir=shm, checkpoint_dir="")
            policy = MeshPolicy({"data": 4, "model": 2}, global_batch=48, slice_size=2)
            ElasticRuntime(job, config=config, mesh_policy=policy).run(steps)
            events = read_events(Path(run_dir) / "events.jsonl")
    finally:
        elastic_runtime.storage.cascade.DiskTier = real  # type: ignore[misc]
    newest, behind = 0, []
    for event in events:
        if isinstance(event, CheckpointCommitted):
            newest = max(newest, event.step or 0)
        elif isinstance(event, StepCompleted):
            behind.append((event.step or 0) - newest)
    return {
        "committed": sum(isinstance(e, CheckpointCommitted) for e in events),
        "skipped": sum(isinstance(e, CheckpointSkipped) for e in events),
        "steps_behind_median": float(np.median(behind)),
        "steps_behind_max": float(max(behind)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    job = flax_lm.make_job(flax_lm.ModelConfig(), global_batch=48)
    tree = jax.tree.map(np.asarray, job.init())
    root = Path(tempfile.mkdtemp(prefix="bench-shm-", dir="/dev/shm"))
    result: dict[str, Any] = {
        "arrays": len(jax.tree.leaves(tree)),
        "state_mb": round(sum(x.nbytes for x in jax.tree.leaves(tree)) / 2**20, 2),
    }
    try:
        tiers = {
            "packed": DiskTier(root / "packed", name="shm", packed=True, sync=False),
            "orbax_layout": DiskTier(root / "orbax", name="shm"),
        }
        measure(tiers, tree, 2)  # warm-up: imports, first files
        for load in ("idle", "busy"):
            stop = threading.Event()
            trainer = threading.Thread(target=train_until, args=(stop, job), daemon=True)
            if load == "busy":
                trainer.start()
                time.sleep(3)  # compiled and stepping
            try:
                seconds = measure(tiers, tree, args.repeats)
            finally:
                stop.set()
                if trainer.is_alive():
                    trainer.join()
            medians = {name: float(np.median(values)) for name, values in seconds.items()}
            for name, median in medians.items():
                result[f"{load}_{name}_ms_median"] = round(median * 1000, 2)
            result[f"{load}_ratio_orbax_to_packed"] = round(medians["orbax_layout"] / medians["packed"], 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, packed in (("packed", True), ("orbax_layout", False)):
        for key, value in in_a_run(job, args.steps, packed=packed).items():
            result[f"run_{name}_{key}"] = value
    result["repeats"] = args.repeats
    result["steps"] = args.steps
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
