"""One training script for both modes: run it directly, or as N worker processes under the launcher.

    python examples/multiprocess_train.py --steps 60                      # one process
    elastic-runtime launch --nprocs 3 -- python examples/multiprocess_train.py --steps 60

Under ``elastic-runtime launch`` each process becomes one worker of a ``jax.distributed`` group (the
``data`` axis spans processes, ``model`` the devices inside each), the controller supervises them, and
``run`` returns in every worker once the group finished (the final state in the lead, process 0, only).
"""

from __future__ import annotations

import argparse

from elastic_runtime import ElasticRuntime, MeshPolicy
from elastic_runtime.testing.demo_model import demo_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=96)
    args = parser.parse_args()
    job = demo_job(global_batch=args.global_batch, features=args.features, hidden=args.hidden)
    # Single-process layout; under the launcher the worker builds the multi-process mesh itself.
    runtime = ElasticRuntime(job, mesh_policy=MeshPolicy({"data": 1, "model": 1}))
    result = runtime.run(args.steps)
    if result.lead:  # once, whatever the number of processes
        print(f"trained {result.step} steps, loss {result.loss:.5f} ({result.mode})")


if __name__ == "__main__":
    main()
