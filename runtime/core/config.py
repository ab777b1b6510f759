"""Runtime configuration: one msgspec Struct, loadable from TOML or from ELASTIC_RUNTIME_* variables."""

from __future__ import annotations

import functools
import operator
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

from elastic_runtime.core.errors import ConfigError

ENV_PREFIX = "ELASTIC_RUNTIME_"

# Ranges, declared once, for every config Struct (``RuntimeConfig`` here, ``LaunchConfig`` in
# runtime/cluster/config.py, ``WorkerSettings``): msgspec checks them when a config is decoded (TOML,
# environment), and ``check_ranges`` in a config's ``__post_init__`` checks the same declarations when one is
# built in code.
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
SecondsOrZero = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: any free one
_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
_NUMBERS = (msgspec.inspect.IntType, msgspec.inspect.FloatType)

StructT = TypeVar("StructT", bound=msgspec.Struct)

SUBSCRIPTION_PATTERN = re.compile(r"projects/[^/\s]+/subscriptions/[^/\s]+")


def check_subscription(subscription: str, *, field: str = "subscription") -> None:
    """Raises ConfigError (a ValueError) unless ``subscription`` is a full name, ``projects/P/subscriptions/S``."""
    if not SUBSCRIPTION_PATTERN.fullmatch(subscription):
        raise ConfigError(f"{field} must look like projects/P/subscriptions/S, got {subscription!r}")


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of one run. Every field has a default that works on a laptop.

    Attributes:
        run_dir: where the event log (``events.jsonl``) is written; no log file when unset.
        snapshot_every: RAM snapshot cadence in steps; 0 turns snapshots off (recovery then restarts at 0).
        snapshot_mtbf_s: the expected mean time between failures; when set, the RAM snapshot cadence follows
            the Young-Daly interval sqrt(2 * copy cost * MTBF), measured as the run goes
            (``elastic_runtime.core.cadence``): fewer copies, a few steps re-done after a failure. ``snapshot_every`` is
            the first cadence. On CPU devices a snapshot is the state itself, no copy: nothing to measure, the cadence
            stays ``snapshot_every``.
        handler_timeout_s: how long one handler call may run before it is cancelled.
        max_pending_events: bound of the bus queue.
        recovery_timeout_s: how long the executor waits for handlers to finish a recovery.
        max_failures: failures a run survives before it gives up (``launch --max-failures`` under launch).
        device_wait_s: how long recovery waits for enough healthy devices before it gives up.
        device_poll_s: interval of device health polls while waiting.
        scale_up_poll_s: interval of the watch for returning devices; unset turns scale-up off.
        precompile: compile the step for likely degraded meshes in the background.
        compile_cache: JAX's persistent compilation cache during the run, so that a restarted or resumed job
            loads its compiled steps: ``run_dir`` (``<run_dir>/xla-cache``, unless the program set
            ``jax_compilation_cache_dir`` itself), ``jax`` (JAX's own setting, untouched), ``off``, or a folder.
        check_data: fingerprint (CRC32C) every batch read, and compare the batches read again after a restore
            with what was read there before; a difference is a ``DataMismatch`` event naming the position.
            Costs a pass over every batch, so off by default.
        event_batch_s: steps run back to back in the worker thread for up to this long before their events
            are published, while the next step computes (a handler's command interrupts at once); 0
            publishes after every step.
        progress: print the run's progress to stderr: the first step, then a line every ``progress_every_s``
            (step, loss and the step's other metrics, step time, mesh, goodput so far), one line per failure,
            re-mesh and recovery, and the end. Off for a quiet run (``--quiet`` on the command line).
        progress_every_s: seconds between two progress lines about steps.
        fingerprint_every: compare the state's data-parallel replicas (a digest per device, on the devices) every
            this many steps, to find silent data corruption: a replica that differs is replayed from the newest
            verified state, and evicted if it differs again (``SilentCorruption``, ``CorruptionHealed``). Unset:
            as often as costs at most 1% of a step (every step on an accelerator, sparser on CPU devices); 0: off.
            Under ``launch``: 1 compares the slices' copies after every step, unset or 0 does not, and any other
            value is a ``ConfigError`` (docs/integrity.md, *Under launch*).

    Checkpointing (``storage/``; see docs/storage.md):
        ram_dir: mirror every RAM snapshot into this directory (e.g. under ``/dev/shm``) so that it survives a
            restart of the process; off when unset.
        checkpoint_dir: the disk tier's directory; by default ``<run_dir>/checkpoints``; "" turns it off.
        disk_every: promote a RAM snapshot to disk each time the step crosses a multiple of this.
        gcs_uri: ``gs://BUCKET[/PREFIX]`` turns the GCS tier on (it needs the disk tier).
        gcs_every: upload the committed disk checkpoint each time the step crosses a multiple of this.
        gcs_workers: parallel GCS transfers.
        keep: committed checkpoints kept per durable tier.
        checkpoint_timeout_s: deadline of one save or upload.
        checkpoint_on_finish: commit the final step to every durable tier when the run ends.

    Maintenance notices (``runtime/maintenance/``, ``handlers/maintenance.py``; see docs/gcp-setup.md):
        maintenance_subscription: ``projects/P/subscriptions/S`` turns the Pub/Sub notice listener on.
        metadata_host: turns the metadata-server watcher on (``metadata.google.internal`` on GCE and TPU VMs).
        instances: this job's instances: names, numeric ids or globs (``t1v-n-1a2b3c4d-w-*``); notices for
            others are ignored. Empty: the keys of ``instance_devices``; both empty: every instance.
        instance_devices: instance -> the device ids it hosts, cordoned before its maintenance window.
        drain_lead_s: drain an instance this long before its maintenance window starts.
        maintenance_checkpoint_tiers: tiers saved to on a maintenance notice; empty: every durable tier.
        preemption_checkpoint_tiers: tiers saved to on a preemption notice; empty: every durable tier.
        pubsub_max_messages: Pub/Sub flow control: messages outstanding at most.
        metadata_poll_timeout_s: ``timeout_sec`` of each metadata long poll.
        require_maintenance_notices: a notice source that does not work at start (no credentials, a subscription
            that does not exist, no permission to read it, a metadata server that does not answer) is a
            ``ConfigError`` before the first step, naming the source and why; off: it is a ``NoticeSourceFailed``
            event and the run goes on without that protection while the source retries. Needs a source.
    """

    run_dir: str | None = None
    snapshot_every: NonNegative = 1
    snapshot_mtbf_s: Seconds | None = None
    handler_timeout_s: Seconds = 30.0
    max_pending_events: Positive = 65536
    recovery_timeout_s: Seconds = 60.0
    max_failures: NonNegative = 10
    device_wait_s: SecondsOrZero = 10.0
    device_poll_s: Seconds = 0.5
    scale_up_poll_s: Seconds | None = 1.0
    precompile: bool = True
    compile_cache: str = "run_dir"
    event_batch_s: SecondsOrZero = 0.05
    check_data: bool = False
    progress: bool = True
    progress_every_s: Seconds = 10.0
    fingerprint_every: NonNegative | None = None
    # --- checkpointing (storage/) ---------------------------------------------------------------------
    ram_dir: str | None = None
    checkpoint_dir: str | None = None
    disk_every: Positive = 100
    gcs_uri: str | None = None
    gcs_every: Positive = 1000
    gcs_workers: Positive = 8
    keep: Positive = 3
    checkpoint_timeout_s: Seconds = 600.0
    checkpoint_on_finish: bool = True
    # --- end checkpointing -------------------------------------------------------------------------------
    # --- maintenance notices (runtime/maintenance, handlers/maintenance.py) -----------------------------
    maintenance_subscription: str | None = None
    metadata_host: str | None = None
    instances: tuple[str, ...] = ()
    instance_devices: dict[str, tuple[int, ...]] = {}
    drain_lead_s: SecondsOrZero = 60.0
    maintenance_checkpoint_tiers: tuple[str, ...] = ()
    preemption_checkpoint_tiers: tuple[str, ...] = ()
    pubsub_max_messages: Positive = 100
    metadata_poll_timeout_s: Seconds = 60.0
    require_maintenance_notices: bool = False
    # --- end maintenance notices -------------------------------------------------------------------------

    def __post_init__(self) -> None:
        self._check_ranges()
        self._check_maintenance()
        self._check_checkpointing()
        self._check_compile_cache()

    def _check_ranges(self) -> None:
        check_ranges(self)

    def _check_compile_cache(self) -> None:
        if not self.compile_cache.strip():
            raise ConfigError("config: compile_cache='' names no folder (use 'off' to turn the cache off)")

    def _check_checkpointing(self) -> None:
        if self.gcs_uri is not None:
            bucket = self.gcs_uri.removeprefix("gs://").split("/", 1)[0]
            if not self.gcs_uri.startswith("gs://") or not bucket:
                raise ConfigError(f"config: gcs_uri={self.gcs_uri!r} must look like gs://BUCKET[/PREFIX]")
            if not (self.checkpoint_dir or (self.checkpoint_dir is None and self.run_dir)):
                raise ConfigError(
                    "config: gcs_uri needs the disk tier (set checkpoint_dir or run_dir): GCS uploads disk checkpoints"
                )

    def _check_maintenance(self) -> None:
        if self.maintenance_subscription is not None:
            check_subscription(self.maintenance_subscription, field="config: maintenance_subscription")
        if self.metadata_host is not None and not self.metadata_host.strip():
            raise ConfigError("config: metadata_host='' names no host (leave it unset to turn the watcher off)")
        if self.require_maintenance_notices and not (self.maintenance_subscription or self.metadata_host):
            raise ConfigError(
                "config: require_maintenance_notices needs a notice source: maintenance_subscription or metadata_host"
            )
        owner: dict[int, str] = {}
        for instance, devices in self.instance_devices.items():
            for device in devices:
                if device < 0:
                    raise ConfigError(f"config: instance_devices[{instance!r}] has a negative device id {device}")
                if device in owner:
                    raise ConfigError(
                        f"config: device {device} is in instance_devices of both {owner[device]!r} and {instance!r}"
                    )
                owner[device] = instance


def check_ranges(config: msgspec.Struct, *, origin: str = "config") -> None:
    """The ``msgspec.Meta`` bounds of every numeric field of ``config``, for a config built in code (decoding
    checks them too; ``__init__`` checks nothing). Call it from the config's ``__post_init__``.

    Raises:
        ConfigError: a numeric field holds something else than a number, or a number out of its range;
            ``origin: field=value ...``.
    """
    for name, bounds in _numeric_fields(type(config)):
        value = getattr(config, name)
        if value is None:
            continue
        if not isinstance(value, int | float):
            raise ConfigError(f"{origin}: {name}={value!r} is not a number")
        for symbol, limit in bounds:
            if not _holds(value, symbol, limit):
                raise ConfigError(f"{origin}: {name}={value!r} is out of range (must be {symbol} {limit})")


@functools.cache
def _numeric_fields(cls: type[msgspec.Struct]) -> tuple[tuple[str, tuple[tuple[str, float], ...]], ...]:
    """(field, its bounds as (symbol, limit) pairs) for every field of ``cls`` typed as a number (or None)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    found = []
    for field in info.fields:
        kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        numbers = [kind for kind in kinds if isinstance(kind, _NUMBERS)]
        if not numbers or not all(isinstance(kind, (*_NUMBERS, msgspec.inspect.NoneType)) for kind in kinds):
            continue
        bounds = tuple(
            (symbol, getattr(kind, bound))
            for kind in numbers
            for bound, symbol in _BOUNDS
            if getattr(kind, bound) is not None
        )
        found.append((field.name, bounds))
    return tuple(found)


def _holds(value: float, symbol: str, limit: float) -> bool:
    compare = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}[symbol]
    return bool(compare(value, limit))


# Fields renamed: a file or environment that still sets the old name is told the new one.
RENAMED = {"max_recoveries": "max_failures"}  # one name for the failure budget, as ``launch --max-failures``


def convert_config(kind: type[StructT], values: Mapping[str, Any], *, origin: str = "config") -> StructT:
    """Build a config Struct of type ``kind`` from plain values (strings are converted, as from the
    environment), with its ``__post_init__`` checks.

    Raises:
        ConfigError: an unknown field, a value of the wrong type, one out of range, or settings that do not
            fit together; names the field.
    """
    for old, new in RENAMED.items():
        if old in values:
            raise ConfigError(f"{origin}: {old} is now called {new}")
    try:
        return msgspec.convert(dict(values), kind, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)  # a ConfigError of __post_init__ may start with the origin already
        raise ConfigError(message if message.startswith(f"{origin}: ") else f"{origin}: {message}") from exc


def config_from_mapping(values: Mapping[str, Any], *, origin: str = "config") -> RuntimeConfig:
    """Build a config from plain values (strings are converted, as from the environment).

    Raises:
        ConfigError: an unknown field, a value of the wrong type, or one out of range; names the field.
    """
    return convert_config(RuntimeConfig, values, origin=origin)


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
