"""elastic-runtime: an asynchronous, event-driven elastic training runtime for JAX."""

from runtime.bus import EventBus, Subscription
from runtime.config import RuntimeConfig, load_config
from runtime.context import RuntimeContext
from runtime.errors import (
    BusClosed,
    ConfigError,
    ElasticRuntimeError,
    EventLogError,
    MeshUnavailable,
    RecoveryError,
    SnapshotUnavailable,
    StepError,
)
from runtime.eventlog import EventLog, read_events
from runtime.events import *  # noqa: F403 - the event catalogue is part of the public API
from runtime.events import __all__ as _event_names
from runtime.executor import RunResult
from runtime.faults import FaultInjector
from runtime.job import DataSource, TrainJob
from runtime.mesh import MeshPolicy
from runtime.runtime import ElasticRuntime

__all__ = [
    "BusClosed",
    "ConfigError",
    "DataSource",
    "ElasticRuntime",
    "ElasticRuntimeError",
    "EventBus",
    "EventLog",
    "EventLogError",
    "FaultInjector",
    "MeshPolicy",
    "MeshUnavailable",
    "RecoveryError",
    "RunResult",
    "RuntimeConfig",
    "RuntimeContext",
    "SnapshotUnavailable",
    "StepError",
    "Subscription",
    "TrainJob",
    "load_config",
    "read_events",
    *_event_names,
]
