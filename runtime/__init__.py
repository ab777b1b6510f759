"""elastic-runtime: an asynchronous, event-driven elastic training runtime for JAX.

What an embedding program needs: the runtime, the job, the mesh policy, the config, the handler context,
the events and the errors. ``EventBus``, ``EventLog`` and fault injection (``runtime.testing``) are
importable from their own modules.

The events and errors are imported with the package; every other name on first use (``runtime.core.lazy``),
because their modules import JAX and every import of a submodule (``runtime.cli``, the controller's) runs
this file first: the controller and ``--help`` never import JAX, and ``ElasticRuntime``
(``runtime.defaults``, which imports ``handlers`` and ``storage``) can be imported after either of those.
"""

from typing import TYPE_CHECKING

# First: its import raises XLA's CPU collective timeout before any backend starts (the module says why).
import runtime.compat.xla  # noqa: F401
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
from runtime.core.events import *  # noqa: F403 - the event catalogue is part of the public API
from runtime.core.events import __all__ as _event_names
from runtime.core.lazy import lazy_exports

if TYPE_CHECKING:
    from runtime.core.config import RuntimeConfig, load_config
    from runtime.core.context import RuntimeContext
    from runtime.core.datasets import IndexedBatches
    from runtime.core.eventlog import read_events
    from runtime.core.executor import RunResult
    from runtime.core.job import DataSource, ProcessBatches, TrainJob
    from runtime.core.mesh import MeshPolicy, ProcessMesh
    from runtime.core.runtime import Component, Runtime
    from runtime.defaults import ElasticRuntime

_HOMES = {
    "runtime.core.config": ["RuntimeConfig", "load_config"],
    "runtime.core.context": ["RuntimeContext"],
    "runtime.core.datasets": ["IndexedBatches"],
    "runtime.core.eventlog": ["read_events"],
    "runtime.core.executor": ["RunResult"],
    "runtime.core.job": ["DataSource", "ProcessBatches", "TrainJob"],
    "runtime.core.mesh": ["MeshPolicy", "ProcessMesh"],
    "runtime.core.runtime": ["Component", "Runtime"],
    "runtime.defaults": ["ElasticRuntime"],
}
__getattr__ = lazy_exports(__name__, _HOMES)

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
