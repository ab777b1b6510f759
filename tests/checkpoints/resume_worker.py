"""A training process for the resume test to kill -9 and to resume: the small demo job on 8 CPU devices,
with disk and GCS tiers, slowed down so that the test can catch it mid-run.

Usage: python resume_worker.py RUN_DIR CHECKPOINT_DIR GS_URI STEPS RESULT.npz [--resume] [--slow]
(the GCS client reaches the emulator through STORAGE_EMULATOR_HOST).
"""

from __future__ import annotations

import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig, TrainJob  # noqa: E402
from elastic_runtime.testing.demo_model import demo_job  # noqa: E402


def job() -> TrainJob:
    return demo_job(global_batch=32, features=32, hidden=256)


def main() -> None:
    run_dir, checkpoint_dir, gcs_uri, steps, result = sys.argv[1:6]
    config = RuntimeConfig(
        run_dir=run_dir,
        checkpoint_dir=checkpoint_dir,
        gcs_uri=gcs_uri,
        disk_every=5,
        gcs_every=5,
        precompile=False,
        scale_up_poll_s=None,
    )
    runtime = ElasticRuntime(job(), config=config, mesh_policy=MeshPolicy({"data": 4, "model": 2}))
    if "--slow" in sys.argv[6:]:
        runtime.at_step_boundary(lambda step: time.sleep(0.05))  # about 20 steps a second: killable mid-run
    done = runtime.run(int(steps), resume="--resume" in sys.argv[6:])
    np.savez(result, *[np.asarray(leaf) for leaf in jax.tree.leaves(done.state)])
    print(f"FINISHED {done.step}", flush=True)


if __name__ == "__main__":
    main()
