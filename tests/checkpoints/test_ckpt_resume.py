"""A job killed with kill -9, its local tiers wiped, resumed from GCS (the emulator) with resume=True: the
final state is bitwise equal to an uninterrupted run's, and the report counts the restart."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from gcs_support import Emulator, client_for

from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig, read_events
from elastic_runtime.analysis.goodput import INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION, goodput
from elastic_runtime.storage.gcs import GcsTier
from elastic_runtime.testing.demo_model import demo_job

WORKER = Path(__file__).with_name("resume_worker.py")
STEPS = 200  # the slowed first process takes more than 10 s to get there: it is killed long before


def test_killed_wiped_and_resumed_from_gcs_matches_an_uninterrupted_run(
    tmp_path: Path, gcs_emulator: Emulator, gcs_uri: str
) -> None:
    run_dir, checkpoints, result = tmp_path / "run", tmp_path / "checkpoints", tmp_path / "final.npz"
    command = [sys.executable, str(WORKER), str(run_dir), str(checkpoints), gcs_uri, str(STEPS), str(result)]
    env = {**os.environ, "STORAGE_EMULATOR_HOST": gcs_emulator.url}
    first = subprocess.Popen([*command, "--slow"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gcs = GcsTier(gcs_uri, client=client_for(gcs_emulator.url), staging_dir=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not [i for i in gcs.list(timeout=30) if i.step >= 10]:
            assert first.poll() is None, first.communicate()[1]
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    out, err = first.communicate()
    assert first.returncode == -signal.SIGKILL and "FINISHED" not in out, err
    in_gcs = max(i.step for i in gcs.list(timeout=30))
    assert 10 <= in_gcs < STEPS
    shutil.rmtree(checkpoints)  # every local tier gone, as on a new machine

    second = subprocess.run([*command, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and f"FINISHED {STEPS}" in second.stdout, second.stderr

    config = RuntimeConfig(run_dir=str(tmp_path / "reference"), checkpoint_dir="", precompile=False)
    reference = ElasticRuntime(
        demo_job(global_batch=32, features=32, hidden=256),
        config=config,
        mesh_policy=MeshPolicy({"data": 4, "model": 2}),
    ).run(STEPS)
    with np.load(result) as resumed:
        leaves = [resumed[f"arr_{i}"] for i in range(len(resumed.files))]
    expected = jax.tree.leaves(reference.state)
    assert len(leaves) == len(expected)
    for got, want in zip(leaves, expected, strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))  # bitwise

    report = goodput(read_events(run_dir / "events.jsonl"))
    assert report.steps == STEPS
    (restart,) = [f for f in report.failures if f.kind == "ProcessRestart"]
    assert restart.restored_from == "gcs" and restart.lost_steps >= 0
    assert report.badput_s[INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION] > 0
