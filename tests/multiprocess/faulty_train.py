"""A worker script for the failure-budget tests: the demo job with a data source that fails at one step in
every attempt, or with a state sharded across processes. Not collected by pytest.

    python tests/multiprocess/faulty_train.py --steps 30 --raise-at 12   # a Python error in the data: StepError
    python tests/multiprocess/faulty_train.py --steps 30 --crash-at 12   # the process dies there, every time
    python tests/multiprocess/faulty_train.py --steps 30 --sharded       # state over 'data': refused
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from typing import Any

from jax.sharding import PartitionSpec as P

from elastic_runtime.cli.demo_multiprocess import FEATURES, GLOBAL_BATCH, HIDDEN
from elastic_runtime.cluster.worker import run_worker
from elastic_runtime.testing.demo_model import demo_job


class FailingData:
    """The demo's data, failing at ``position``: raising there, or crashing the process (as a native crash
    in a data loader would) after printing the traceback."""

    def __init__(self, inner: Any, position: int, *, crash: bool) -> None:
        self.inner, self.position, self.crash = inner, position, crash

    def batch(self, position: int) -> Any:
        if position == self.position:
            try:
                raise ValueError(f"corrupt record at data position {position}")
            except ValueError:
                if not self.crash:
                    raise
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(3)
        return self.inner.batch(position)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--raise-at", type=int, default=0, help="step whose data raises")
    parser.add_argument("--crash-at", type=int, default=0, help="step whose data kills the process")
    parser.add_argument("--sharded", action="store_true", help="shard the state over 'data' (across processes)")
    args = parser.parse_args()
    job = demo_job(global_batch=GLOBAL_BATCH, features=FEATURES, hidden=HIDDEN)
    at = args.raise_at or args.crash_at
    if at:
        job = dataclasses.replace(job, data=FailingData(job.data, at - 1, crash=bool(args.crash_at)))
    if args.sharded:
        job = dataclasses.replace(job, state_specs=P("data"))
    run_worker(job, steps=args.steps)


if __name__ == "__main__":
    main()
