"""A training script for ``elastic-runtime launch``: the demo model, trained by every worker process.

elastic-runtime launch --nprocs 3 -- python examples/multiprocess_train.py --steps 60
"""

from __future__ import annotations

import argparse

from runtime.demo_model import demo_job
from runtime.worker import run_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=96)
    args = parser.parse_args()
    job = demo_job(global_batch=args.global_batch, features=args.features, hidden=args.hidden)
    run_worker(job, steps=args.steps)


if __name__ == "__main__":
    main()
