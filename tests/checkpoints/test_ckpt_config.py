"""The checkpointing block of RuntimeConfig: defaults, validation, and what the runtime builds from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_runtime.core.config import RuntimeConfig, load_config
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.snapshot import RamTier
from elastic_runtime.storage.cascade import TieredCheckpointer


def test_defaults_ram_and_disk_under_the_run_dir_gcs_off(tmp_path: Path) -> None:
    checkpointer = TieredCheckpointer.from_config(RuntimeConfig(run_dir=str(tmp_path)), RamTier())
    assert checkpointer is not None and checkpointer.gcs is None and checkpointer.shm is None
    assert checkpointer.disk is not None and checkpointer.disk.root == tmp_path / "checkpoints"
    assert (checkpointer.disk_every, checkpointer.gcs_every, checkpointer.keep) == (100, 1000, 3)
    assert TieredCheckpointer.from_config(RuntimeConfig(), RamTier()) is None  # nowhere to write
    assert TieredCheckpointer.from_config(RuntimeConfig(run_dir=str(tmp_path), checkpoint_dir=""), RamTier()) is None


def test_named_bucket_and_ram_dir_turn_their_tiers_on(tmp_path: Path) -> None:
    config = RuntimeConfig(
        checkpoint_dir=str(tmp_path / "c"), gcs_uri="gs://b/runs/x", ram_dir=str(tmp_path / "shm"), gcs_workers=3
    )
    checkpointer = TieredCheckpointer.from_config(config, RamTier())
    assert checkpointer is not None and checkpointer.gcs is not None and checkpointer.shm is not None
    assert (checkpointer.gcs.bucket_name, checkpointer.gcs.prefix, checkpointer.gcs.workers) == ("b", "runs/x", 3)
    assert [t.name for t in checkpointer.restore_tiers] == ["shm", "disk", "gcs"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"keep": 0}, "keep=0"),
        ({"disk_every": 0}, "disk_every=0"),
        ({"gcs_every": -1}, "gcs_every=-1"),
        ({"checkpoint_timeout_s": 0}, "checkpoint_timeout_s"),
        ({"gcs_uri": "s3://b/x", "run_dir": "r"}, "gs://BUCKET"),
        ({"gcs_uri": "gs:///x", "run_dir": "r"}, "gs://BUCKET"),
        ({"gcs_uri": "gs://b/x"}, "needs the disk tier"),
        ({"gcs_uri": "gs://b/x", "run_dir": "r", "checkpoint_dir": ""}, "needs the disk tier"),
    ],
)
def test_bad_values_name_the_field(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RuntimeConfig(**values)  # type: ignore[arg-type]


def test_from_the_environment(tmp_path: Path) -> None:
    env = {
        "ELASTIC_RUNTIME_CHECKPOINT_DIR": str(tmp_path),
        "ELASTIC_RUNTIME_GCS_URI": "gs://bucket/p",
        "ELASTIC_RUNTIME_DISK_EVERY": "5",
        "ELASTIC_RUNTIME_KEEP": "2",
    }
    config = load_config(env=env)
    assert (config.checkpoint_dir, config.gcs_uri, config.disk_every, config.keep) == (
        str(tmp_path),
        "gs://bucket/p",
        5,
        2,
    )
    with pytest.raises(ConfigError, match="keep"):
        load_config(env={**env, "ELASTIC_RUNTIME_KEEP": "many"})
