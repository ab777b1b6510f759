"""The GCS tier against the real emulator, through a proxy that injects 5xx, slow answers and drops."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from gcs_support import client_for, small_state

from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.gcs import GcsTier
from elastic_runtime.testing.faultproxy import FaultProxy


def _snapshot(step: int) -> HostSnapshot:
    return HostSnapshot(
        step=step, data_position=step + 1, tree=small_state(step), nbytes=0, seconds=0.0, metadata={"rng": [step, 7]}
    )


def test_uploads_commit_through_30_percent_faults(tmp_path: Path, gcs_uri: str, fault_proxy: FaultProxy) -> None:
    disk = DiskTier(tmp_path / "disk")
    fault_proxy.rate = 0.3
    fault_proxy.slow_s = 1.2
    gcs = GcsTier(
        gcs_uri,
        client=client_for(fault_proxy.url),
        request_timeout_s=1.0,
        workers=4,
        max_attempts=30,
        backoff_s=0,
    )
    for step in (1, 2, 3):
        info = disk.save(_snapshot(step), timeout=60)
        gcs.upload(info.location, timeout=90)
    assert sum(fault_proxy.injected.values()) >= 5, fault_proxy.injected
    assert gcs.retries >= 5
    fault_proxy.rate = 0.0
    assert [i.step for i in gcs.list(timeout=30)] == [3, 2, 1]
    restored = gcs.latest(small_state(0))
    assert restored.step == 3 and restored.data_position == 4 and restored.metadata == {"rng": [3, 7]}
    for a, b in zip(jax.tree.leaves(restored.tree), jax.tree.leaves(small_state(3)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_resumable_uploads_commit_through_faults(
    tmp_path: Path, gcs_uri: str, fault_proxy: FaultProxy, seed: int
) -> None:
    # Files above chunk_size go as resumable uploads (several requests each); faults may hit any of them.
    big = {"w": np.arange(3 << 18, dtype=np.float32), "b": np.ones(7, np.float32)}  # a 3 MiB file: 3 pieces
    info = DiskTier(tmp_path / "disk").save(
        HostSnapshot(step=4, data_position=5, tree=big, nbytes=0, seconds=0.0, metadata={}), timeout=60
    )
    fault_proxy.reseed(seed)
    fault_proxy.rate = 0.3
    fault_proxy.faults = ("error", "drop", "drop_after")
    gcs = GcsTier(gcs_uri, client=client_for(fault_proxy.url), chunk_size=1 << 20, max_attempts=30, backoff_s=0)
    gcs.upload(info.location, timeout=120)
    assert sum("uploadType=resumable" in seen for seen in fault_proxy.seen) >= 3
    assert sum(fault_proxy.injected.values()) >= 1 and gcs.retries >= 1
    fault_proxy.rate = 0.0
    restored = gcs.restore(4, None, timeout=60)
    np.testing.assert_array_equal(restored.tree["w"], big["w"])


def test_the_end_of_a_run_says_what_it_waits_for(
    tmp_path: Path, gcs_uri: str, fault_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig
    from elastic_runtime.testing.demo_model import demo_job

    fault_proxy.rate, fault_proxy.faults, fault_proxy.slow_s = 1.0, ("slow",), 0.3  # every request held 0.3 s
    config = RuntimeConfig(run_dir=str(tmp_path), gcs_uri=gcs_uri, disk_every=1000, precompile=False)
    policy = MeshPolicy({"data": 4, "model": 2})
    runtime = ElasticRuntime(demo_job(global_batch=24, features=16, hidden=64), config=config, mesh_policy=policy)
    assert runtime.checkpointer is not None and runtime.checkpointer.gcs is not None
    runtime.checkpointer.gcs._client = client_for(fault_proxy.url)
    runtime.checkpointer.report_every_s = 0.2
    with caplog.at_level("WARNING", logger="elastic_runtime.storage.cascade"):
        result = runtime.run(3)
    waits = [r.getMessage() for r in caplog.records if "the run is over; waiting for" in r.getMessage()]
    assert waits, caplog.text
    assert any(f"uploading step 3 to {gcs_uri}" in w and "MiB" in w for w in waits), waits
    assert result.step == 3 and runtime.checkpointer.newest.get("gcs") == 3  # and it did finish
