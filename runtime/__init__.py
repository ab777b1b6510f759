"""elastic-runtime: an asynchronous, event-driven elastic training runtime for JAX.

What an embedding program needs: the runtime, the job, the mesh policy, the config, the handler context,
the events and the errors. ``EventBus``, ``EventLog`` and fault injection (``runtime.testing``) are
importable from their own modules.

``ElasticRuntime`` wires in the built-in handlers and tiers (``runtime.defaults``), which import
``handlers`` and ``storage``; both of those import ``runtime.core``. It is therefore loaded on first use,
so that ``import storage`` or ``import handlers`` works as the first import of a program.
"""

from typing import TYPE_CHECKING, Any

# First: its import raises XLA's CPU collective timeout before any backend starts (the module says why).
import runtime.compat.xla  # noqa: F401
from runtime.core.config import RuntimeConfig, load_config
from runtime.core.context import RuntimeContext
from runtime.core.datasets import IndexedBatches
from runtime.core.errors import (
    BusClosed,
    CheckpointInvalid,
    ConfigError,
    ElasticRuntimeError,
    EventLogError,
    JobUnsupported,
    MeshUnavailable,
    RecoveryError,
    SnapshotUnavailable,
    StepError,
    StorageError,
    UnsupportedInMode,
)
from runtime.core.eventlog import read_events
from runtime.core.events import *  # noqa: F403 - the event catalogue is part of the public API
from runtime.core.events import __all__ as _event_names
from runtime.core.executor import RunResult
from runtime.core.job import DataSource, ProcessBatches, TrainJob
from runtime.core.mesh import MeshPolicy, ProcessMesh
from runtime.core.runtime import Component, Runtime

if TYPE_CHECKING:
    from runtime.defaults import ElasticRuntime

__all__ = [
    "BusClosed",
    "CheckpointInvalid",
    "Component",
    "ConfigError",
    "DataSource",
    "ElasticRuntime",
    "ElasticRuntimeError",
    "EventLogError",
    "IndexedBatches",
    "JobUnsupported",
    "MeshPolicy",
    "ProcessMesh",
    "ProcessBatches",
    "MeshUnavailable",
    "RecoveryError",
    "RunResult",
    "Runtime",
    "RuntimeConfig",
    "RuntimeContext",
    "SnapshotUnavailable",
    "StepError",
    "StorageError",
    "TrainJob",
    "UnsupportedInMode",
    "load_config",
    "read_events",
    *_event_names,
]


def __getattr__(name: str) -> Any:
    if name == "ElasticRuntime":
        from runtime.defaults import ElasticRuntime

        return ElasticRuntime
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
