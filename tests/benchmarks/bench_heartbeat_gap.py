"""How long a worker's heartbeat thread goes without running while the worker writes and restores a state of
``--mb`` MB: the real parts of a worker's path, in one process, beside a thread that ticks every ``--tick-ms``
(as the worker's heartbeat thread does every 0.2 s) and records the longest gap between its ticks.

The phases, each timed and with its own longest gap: ``import`` (what a worker's first replica write imports:
Orbax, for its handler's name in the checkpoint's metadata; once per process), ``snapshot`` (the device-to-host
copy of the state, ``elastic_runtime.storage.boxes.local_copy``, what every committed step's RAM replica takes),
``write`` (its replica file, ``ReplicaFiles.save``: the files and their CRC32C), ``read`` (``ReplicaFiles.read``: read
and verified) and ``restore`` (``SliceRestore``: the host boxes copied into the stacked arrays and the compiled
selection).
A gap is a tick's lateness: the time between two ticks less the sleep between them. A heartbeat is lost when
the gap passes the controller's timeout (by default 2 s before a worker's first step, 1 s after). On a loaded
machine most of a gap can be waiting for a CPU, which no change to this process removes; the kernel counts
that wait for the ticking thread (``/proc/thread-self/schedstat``), and the rest of the gap, ``gil``, is the
thread's wait for the GIL (and for the sleep's end): the part another thread of this process holding the GIL
causes.

    nice -n 19 .venv/bin/python tests/benchmarks/bench_heartbeat_gap.py --mb 384 [--leaves 16] [--dir /dev/shm]

The last line is JSON: per phase its seconds, longest gap and longest GIL wait, the longest of each overall, and
the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastic_runtime.cluster.collectives import SliceRestore
from elastic_runtime.compat.orbax import pytree_handler_name
from elastic_runtime.storage.boxes import local_copy
from elastic_runtime.storage.replicas import ReplicaFiles, replica


class Ticker:
    """A thread that sleeps ``interval`` seconds at a time and records how late each wake-up was."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.longest = 0.0  # the latest tick's lateness
        self.gil = 0.0  # the longest lateness less the tick's wait for a CPU
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ticker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last, queued = time.monotonic(), _queued()
        while not self._stop.is_set():
            time.sleep(self.interval)
            now, now_queued = time.monotonic(), _queued()
            late = now - last - self.interval
            self.longest = max(self.longest, late)
            self.gil = max(self.gil, late - (now_queued - queued))
            last, queued = now, now_queued

    @contextmanager
    def phase(self, name: str, results: dict[str, Any]) -> Iterator[None]:
        self.longest = self.gil = 0.0
        started = time.monotonic()
        yield
        seconds = time.monotonic() - started
        time.sleep(2 * self.interval)  # a gap still open at the phase's end is counted in it
        gap, gil = round(self.longest, 4), round(self.gil, 4)
        results[name] = {"seconds": round(seconds, 3), "max_gap_s": gap, "max_gil_s": gil}
        print(f"{name}: {seconds:.3f} s, longest gap {gap * 1000:.1f} ms, longest GIL wait {gil * 1000:.1f} ms")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _queued() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (the kernel's schedstat)."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def build_state(mb: float, leaves: int, sharding: NamedSharding) -> dict[str, jax.Array]:
    rows = max(1, int(mb * 2**20 / leaves / 4 / 1024))
    make: Callable[[int], jax.Array] = jax.jit(
        lambda i: jnp.arange(rows * 1024, dtype=jnp.float32).reshape(rows, 1024) + i, out_shardings=sharding
    )
    return {f"w{i:02d}": make(i) for i in range(leaves)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=384.0, help="the state's size (one worker's shards)")
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--tick-ms", type=float, default=5.0)
    parser.add_argument("--dir", default="/dev/shm", help="where the replica files go (a temporary folder in it)")
    args = parser.parse_args()

    mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("model"))
    state = build_state(args.mb, args.leaves, sharding)
    jax.block_until_ready(state)
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    restorer = SliceRestore(like, jax.tree.map(lambda _: sharding, state), neighbours=False)
    folder = tempfile.mkdtemp(prefix="bench-heartbeat-", dir=args.dir)
    replicas = ReplicaFiles(folder, "worker-0")
    results: dict[str, Any] = {}
    ticker = Ticker(args.tick_ms / 1000)
    try:
        with ticker.phase("import", results):
            pytree_handler_name()
        with ticker.phase("snapshot", results):
            boxes = local_copy(state)
        with ticker.phase("write", results):
            replicas.save(replica(1, 1, boxes))
            replicas.wait()
        del boxes
        with ticker.phase("read", results):
            read = replicas.read(1, replicas.listed()[1], like)
        with ticker.phase("restore", results):
            restored, _ = restorer(read.tree, read.data_position, source=0)
            jax.block_until_ready(restored)
        assert all(bool((restored[k] == state[k]).all()) for k in state), "the restore changed the state"
    finally:
        ticker.stop()
        replicas.close()
        shutil.rmtree(folder, ignore_errors=True)
    nbytes = sum(a.nbytes for a in state.values())
    summary = {
        "mb": round(nbytes / 2**20, 1),
        "leaves": args.leaves,
        "devices": len(jax.devices()),
        "phases": results,
        "max_gap_s": max(r["max_gap_s"] for r in results.values()),
        "max_gil_s": max(r["max_gil_s"] for r in results.values()),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
