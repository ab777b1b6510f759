"""What the durable checkpoint's state digest costs (issue 63), beside what it guards. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_state_digest.py [--mb 32 256] [--repeats 5] [--json]

A state of 4 float32 leaves on 8 CPU devices (data 4 x model 2, split over ``model``). Per size, medians of the
repeats: ``state_digest`` on the devices (once per durable step, in the step loop) against the disk tier's save of
the same state (``DiskTier.save``, which it precedes); and a disk restore with the digest recorded (the host
digest checked, ``storage/tier.py``) against the same restore without one. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from elastic_runtime.core.fingerprint import STATE_DIGEST, state_digest  # noqa: E402
from elastic_runtime.core.snapshot import HostSnapshot  # noqa: E402
from elastic_runtime.storage.disk import DiskTier  # noqa: E402


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def one_size(mb: int, repeats: int, root: Path) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    side = int((mb * (1 << 20) // 16) ** 0.5) // 8 * 8  # 4 square leaves of float32
    host = {f"w{i}": np.random.default_rng(i).standard_normal((side, side), dtype=np.float32) for i in range(4)}
    placed = {k: jax.device_put(v, NamedSharding(mesh, P(None, "model"))) for k, v in host.items()}
    digest = f"{state_digest(placed):08x}"  # compiled here, not in the figures
    nbytes = sum(v.nbytes for v in host.values())
    figures: dict[str, list[float]] = {"digest_s": [], "save_s": [], "restore_checked_s": [], "restore_plain_s": []}
    for repeat in range(repeats):
        figures["digest_s"].append(timed(lambda: state_digest(placed)))
        for checked in (True, False):
            disk = DiskTier(root / f"r{repeat}-{checked}", check_space=False)
            metadata = {STATE_DIGEST: digest} if checked else {}
            snapshot = HostSnapshot(step=1, data_position=1, tree=host, nbytes=nbytes, seconds=0.0, metadata=metadata)
            save_s = timed(lambda disk=disk, snapshot=snapshot: disk.save(snapshot, timeout=600))
            if checked:
                figures["save_s"].append(save_s)
            key = "restore_checked_s" if checked else "restore_plain_s"
            figures[key].append(timed(lambda disk=disk: disk.restore(1, timeout=600)))
            shutil.rmtree(disk.root, ignore_errors=True)
    medians = {k: round(statistics.median(v), 4) for k, v in figures.items()}
    return {
        "mb": round(nbytes / 2**20),
        **medians,
        "digest_over_save": round(medians["digest_s"] / medians["save_s"], 3),
        "restore_checked_over_plain": round(medians["restore_checked_s"] / medians["restore_plain_s"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-digest-") as folder:
        sizes = [one_size(mb, args.repeats, Path(folder)) for mb in args.mb]
    result = {"load": [round(load, 2), round(os.getloadavg()[0], 2)], "repeats": args.repeats, "sizes": sizes}
    if not args.json:
        for size in sizes:
            print(size)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
