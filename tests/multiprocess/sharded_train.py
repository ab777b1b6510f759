"""A training script whose state is split over the processes of a slice, for ``test_sharded_init.py`` and
``tests/benchmarks/bench_memory.py``. Not collected.

    python tests/multiprocess/sharded_train.py --steps 8 --mb 64 [--init jit|host] [--data process|global]
        [--reads FOLDER]

The state is ``--leaves`` float32 arrays of ``--mb`` MB in all, each split by rows over ``model``. ``--init
jit`` builds it with JAX operations (under the runtime's ``jit``, each process computes only its shards);
``--init host`` returns the same values as NumPy arrays, made whole on every host. The step is elementwise and
its batch's sum is exact (small integers), so every layout computes the same bits.
"""

from __future__ import annotations

from memory_limit import confine

confine()  # first, before anything large is allocated: nothing when the test sets no limit

import argparse
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from elastic_runtime import TrainJob
from elastic_runtime.cluster.protocol import ENV_WORKER
from elastic_runtime.cluster.worker import run_worker

COLUMNS = 1024
FEATURES = 16
GLOBAL_BATCH = 48


def rows_per_leaf(mb: float, leaves: int) -> int:
    """Rows of each leaf: ``mb`` MB in all, a multiple of 16 (any slice's device count divides it)."""
    return max(16, int(mb * 2**20 / leaves / (4 * COLUMNS)) // 16 * 16)


def jit_init(rows: int, leaves: int) -> Any:
    def init() -> dict[str, list[jax.Array]]:
        base = jnp.arange(rows * COLUMNS, dtype=jnp.int32).reshape(rows, COLUMNS) % 251
        return {"w": [(base + i).astype(jnp.float32) / 8 for i in range(leaves)]}

    return init


def host_init(rows: int, leaves: int) -> Any:
    def init() -> dict[str, list[np.ndarray]]:
        base = np.arange(rows * COLUMNS, dtype=np.int32).reshape(rows, COLUMNS) % 251
        return {"w": [(base + i).astype(np.float32) / np.float32(8) for i in range(leaves)]}

    return init


class GlobalRows:
    """Global batch ``p``: ``GLOBAL_BATCH`` rows of small integers, read whole by every process."""

    global_batch = GLOBAL_BATCH

    def batch(self, position: int) -> dict[str, np.ndarray]:
        return _rows(position, 0, GLOBAL_BATCH)


class Rows(GlobalRows):
    """The same batches, each process reading only its rows (``elastic_runtime.core.job.ProcessBatches``)."""

    def rows(self, position: int, start: int, stop: int) -> dict[str, np.ndarray]:
        return _rows(position, start, stop)


class LoggedRows(Rows):
    """``Rows`` that append every read, ``[position, start, stop]``, to ``<folder>/<worker id>.jsonl``, in order."""

    def __init__(self, folder: str) -> None:
        self.log = Path(folder) / f"{os.environ[ENV_WORKER]}.jsonl"
        self.log.parent.mkdir(parents=True, exist_ok=True)

    def rows(self, position: int, start: int, stop: int) -> dict[str, np.ndarray]:
        with self.log.open("a") as log:
            log.write(json.dumps([position, start, stop]) + "\n")
        return super().rows(position, start, stop)


def _rows(position: int, start: int, stop: int) -> dict[str, np.ndarray]:
    index = np.arange(start, stop, dtype=np.int64)[:, None] * FEATURES + np.arange(FEATURES)
    return {"x": ((index + position * 7) % 13).astype(np.float32)}


def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    total = jnp.sum(batch["x"])
    # The loss reads every shard: each step is a collective of the whole group, as a real model's is. (With
    # only the batch's sum, a slice's processes stepped on past a dead peer's, beyond the replicas kept.)
    loss = total + sum(jnp.mean(w) for w in state["w"])
    return {"w": [w * 0.5 + total for w in state["w"]]}, {"loss": loss}


def job(
    mb: float, leaves: int, init: str, data: str = "process", split: bool = False, reads: str | None = None
) -> TrainJob:
    """``split``: the batch's rows over every device (``data`` and ``model``), not over ``data`` only. ``reads``:
    a folder where each process logs the rows it reads (``LoggedRows``)."""
    rows = rows_per_leaf(mb, leaves)
    source = GlobalRows() if data == "global" else Rows() if reads is None else LoggedRows(reads)
    return TrainJob(
        init=(jit_init if init == "jit" else host_init)(rows, leaves),
        step=step,
        data=source,
        state_specs={"w": [P("model", None)] * leaves},
        batch_spec=P(("data", "model")) if split else P("data"),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--mb", type=float, default=64)
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--init", choices=("jit", "host"), default="jit")
    parser.add_argument("--data", choices=("process", "global"), default="process")
    parser.add_argument("--split-batch", action="store_true", help="the batch's rows over every device")
    parser.add_argument("--reads", help="a folder: log the rows each process reads (with --data process)")
    args = parser.parse_args()
    run_worker(job(args.mb, args.leaves, args.init, args.data, args.split_batch, args.reads), steps=args.steps)


if __name__ == "__main__":
    main()
