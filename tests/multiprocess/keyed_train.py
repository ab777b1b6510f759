"""The keyed model (``elastic_runtime.testing.keyed_model``) as a training script, for ``test_real_model_launch.py``.
Not collected.

    python tests/multiprocess/keyed_train.py --steps 30 [--trace-log FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from elastic_runtime import ElasticRuntime, MeshPolicy
from elastic_runtime.testing.keyed_model import keyed_job


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--trace-log", type=Path, default=None)
    args = parser.parse_args()
    job = keyed_job(trace_log=args.trace_log)
    runtime = ElasticRuntime(job, mesh_policy=MeshPolicy({"data": 1, "fsdp": 1, "tensor": 1}))
    runtime.run(args.steps)


if __name__ == "__main__":
    main()
