"""The ``/dev/shm`` mirror: one save of the flax example's state (91 arrays) in the packed layout the mirror
writes (one file, no fsync) against Orbax's layout as the disk tier writes it (two files and a directory
per array, fsynced), both through ``DiskTier.save`` into ``/dev/shm``, alternating, on an idle machine and
while the example's training step runs back to back in another thread (a busy host, as during training).

    .venv/bin/python tests/benchmarks/bench_shm_mirror.py [--repeats 20] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
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

from runtime.core.snapshot import HostSnapshot  # noqa: E402
from storage.disk import DiskTier  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flax_lm.py"


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("flax_lm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["flax_lm"] = module
    spec.loader.exec_module(module)
    return module


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    example = load_example()
    job = example.make_job(example.ModelConfig(), global_batch=48)
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
    result["repeats"] = args.repeats
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
