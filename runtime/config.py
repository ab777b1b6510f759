"""Runtime configuration: one msgspec Struct, loadable from TOML or from ELASTIC_RUNTIME_* variables."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from runtime.errors import ConfigError

ENV_PREFIX = "ELASTIC_RUNTIME_"


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of one run. Every field has a default that works on a laptop.

    Attributes:
        run_dir: where the event log (``events.jsonl``) is written; no log file when unset.
        snapshot_every: RAM snapshot cadence in steps; 0 turns snapshots off (recovery then restarts at 0).
        handler_timeout_s: how long one handler call may run before it is cancelled.
        max_pending_events: bound of the bus queue.
        recovery_timeout_s: how long the executor waits for handlers to finish a recovery.
        max_recoveries: failures a run survives before it gives up.
        device_wait_s: how long recovery waits for enough healthy devices before it gives up.
        device_poll_s: interval of device health polls while waiting.
        scale_up_poll_s: interval of the watch for returning devices; unset turns scale-up off.
        precompile: compile the step for likely degraded meshes in the background.

    Checkpointing (``storage/``; see docs/storage.md):
        checkpoint_dir: the disk tier's directory; by default ``<run_dir>/checkpoints``; "" turns it off.
        disk_every: promote the RAM snapshot to disk every this many steps (a multiple of snapshot_every).
        gcs_uri: ``gs://BUCKET[/PREFIX]`` turns the GCS tier on (it needs the disk tier).
        gcs_every: upload the committed disk checkpoint each time the step crosses a multiple of this.
        gcs_workers: parallel GCS transfers.
        keep: committed checkpoints kept per durable tier.
        checkpoint_timeout_s: deadline of one save or upload.
        checkpoint_on_finish: commit the final step to every durable tier when the run ends.
    """

    run_dir: str | None = None
    snapshot_every: int = 1
    handler_timeout_s: float = 30.0
    max_pending_events: int = 65536
    recovery_timeout_s: float = 60.0
    max_recoveries: int = 10
    device_wait_s: float = 10.0
    device_poll_s: float = 0.5
    scale_up_poll_s: float | None = 1.0
    precompile: bool = True
    # --- checkpointing (storage/; owner: the storage issue) --------------------------------------------
    checkpoint_dir: str | None = None
    disk_every: int = 10
    gcs_uri: str | None = None
    gcs_every: int = 100
    gcs_workers: int = 8
    keep: int = 3
    checkpoint_timeout_s: float = 600.0
    checkpoint_on_finish: bool = True
    # --- end checkpointing -------------------------------------------------------------------------------

    def __post_init__(self) -> None:
        checks = {
            "snapshot_every": self.snapshot_every >= 0,
            "handler_timeout_s": self.handler_timeout_s > 0,
            "max_pending_events": self.max_pending_events >= 1,
            "recovery_timeout_s": self.recovery_timeout_s > 0,
            "max_recoveries": self.max_recoveries >= 0,
            "device_wait_s": self.device_wait_s >= 0,
            "device_poll_s": self.device_poll_s > 0,
            "scale_up_poll_s": self.scale_up_poll_s is None or self.scale_up_poll_s > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"config: {name}={getattr(self, name)!r} is out of range")
        self._check_checkpointing()

    def _check_checkpointing(self) -> None:
        checks = {
            "disk_every": self.disk_every >= 1,
            "gcs_every": self.gcs_every >= 1,
            "gcs_workers": self.gcs_workers >= 1,
            "keep": self.keep >= 1,
            "checkpoint_timeout_s": self.checkpoint_timeout_s > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"config: {name}={getattr(self, name)!r} is out of range")
        if self.snapshot_every and self.disk_every % self.snapshot_every:
            raise ConfigError(
                f"config: disk_every={self.disk_every} must be a multiple of snapshot_every={self.snapshot_every} "
                "(the disk tier writes RAM snapshots)"
            )
        if self.gcs_uri is not None:
            bucket = self.gcs_uri.removeprefix("gs://").split("/", 1)[0]
            if not self.gcs_uri.startswith("gs://") or not bucket:
                raise ConfigError(f"config: gcs_uri={self.gcs_uri!r} must look like gs://BUCKET[/PREFIX]")
            if not (self.checkpoint_dir or (self.checkpoint_dir is None and self.run_dir)):
                raise ConfigError(
                    "config: gcs_uri needs the disk tier (set checkpoint_dir or run_dir): GCS uploads disk checkpoints"
                )


def config_from_mapping(values: Mapping[str, Any], *, origin: str = "config") -> RuntimeConfig:
    """Build a config from plain values (strings are converted, as from the environment).

    Raises:
        ConfigError: an unknown field, a value of the wrong type, or one out of range; names the field.
    """
    try:
        return msgspec.convert(dict(values), RuntimeConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{origin}: {exc}") from exc


def load_config(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> RuntimeConfig:
    """Defaults, overridden by the ``[runtime]`` table of a TOML file, overridden by the environment."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            document = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        values.update(document.get("runtime", {}))
    env = os.environ if env is None else env
    for key, value in env.items():
        if key.startswith(ENV_PREFIX):
            values[key[len(ENV_PREFIX) :].lower()] = None if value == "" else value
    return config_from_mapping(values, origin=str(path) if path else "environment")
