"""check_data: a data source that gives other bytes on a replay after a restore is caught and named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from elastic_runtime import DataMismatch, ElasticRuntime, MeshPolicy, RuntimeConfig, TrainJob, read_events
from elastic_runtime.core.datacheck import fingerprint
from elastic_runtime.testing import FaultInjector
from elastic_runtime.testing.demo_model import demo_job


class Unseeded:
    """Fresh random numbers on every call: what a data loader without a position-keyed seed does."""

    def __init__(self, like: Any) -> None:
        self.like = like

    def batch(self, position: int) -> Any:
        return {k: np.random.default_rng().standard_normal(v.shape).astype(v.dtype) for k, v in self.like.items()}


def run_with_a_fault(tmp_path: Path, deterministic: bool) -> list[DataMismatch]:
    job = demo_job(global_batch=24, features=16, hidden=64)
    if not deterministic:
        data = Unseeded(job.data.batch(0))
        job = TrainJob(init=job.init, step=job.step, data=data, state_specs=job.state_specs, batch_spec=job.batch_spec)
    config = RuntimeConfig(run_dir=str(tmp_path), check_data=True, precompile=False, scale_up_poll_s=None)
    policy = MeshPolicy({"data": 4, "model": 1}, global_batch=24)  # 4 spare devices: a lost one is replaced
    FaultInjector().lose_devices(6, [2]).attach(ElasticRuntime(job, config=config, mesh_policy=policy)).run(12)
    return [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, DataMismatch)]


def test_a_source_that_changes_on_replay_is_named_by_position(tmp_path: Path) -> None:
    mismatches = run_with_a_fault(tmp_path, deterministic=False)
    assert mismatches, "the replayed batch was not compared"
    assert all(4 <= m.position <= 7 and m.expected_crc32c != m.got_crc32c for m in mismatches)
    assert f"position {mismatches[0].position}" in mismatches[0].message


def test_a_deterministic_source_passes(tmp_path: Path) -> None:
    assert run_with_a_fault(tmp_path, deterministic=True) == []


@pytest.mark.parametrize(
    "other",
    [
        {"x": np.arange(4, dtype=np.float32) + 1},  # other bytes
        {"x": np.arange(4, dtype=np.int32)},  # the same values, another dtype
        {"x": np.arange(4, dtype=np.float32).reshape(2, 2)},  # another shape
        {"y": np.arange(4, dtype=np.float32)},  # another structure
    ],
)
def test_the_fingerprint_sees_bytes_dtype_shape_and_structure(other: dict[str, np.ndarray]) -> None:
    base = {"x": np.arange(4, dtype=np.float32)}
    assert fingerprint(base) == fingerprint({"x": np.arange(4, dtype=np.float32)})
    assert fingerprint(base) != fingerprint(other)
