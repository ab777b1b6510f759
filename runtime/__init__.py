"""elastic-runtime: an asynchronous, event-driven elastic training runtime for JAX.

What an embedding program needs: the runtime, the job, the mesh policy, the config, the handler context,
the events and the errors. ``EventBus``, ``EventLog`` and fault injection (``elastic_runtime.testing``) are
importable from their own modules.

The events and errors are imported with the package; every other name on first use (``elastic_runtime.core.lazy``),
because their modules import JAX and every import of a submodule (``elastic_runtime.cli``, the controller's) runs
this file first: the controller and ``--help`` never import JAX, and ``ElasticRuntime``
(``elastic_runtime.defaults``, which imports ``elastic_runtime.handlers`` and
``elastic_runtime.storage``) can be imported after either of those.
"""

from typing import TYPE_CHECKING

# First: its import raises XLA's CPU collective timeout before any backend starts (the module says why).
import elastic_runtime.compat.xla  # noqa: F401
from elastic_runtime.core.errors import (
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
from elastic_runtime.core.events import *  # noqa: F403 - the event catalogue is part of the public API
from elastic_runtime.core.events import __all__ as _event_names
from elastic_runtime.core.handler_context import HandlerContext
from elastic_runtime.core.lazy import lazy_exports

if TYPE_CHECKING:
    from elastic_runtime.core.compare import compare_states
    from elastic_runtime.core.config import RuntimeConfig, load_config
    from elastic_runtime.core.context import RuntimeContext
    from elastic_runtime.core.datasets import IndexedBatches
    from elastic_runtime.core.eventlog import read_events
    from elastic_runtime.core.executor import RunResult
    from elastic_runtime.core.job import DataSource, ProcessBatches, TrainJob
    from elastic_runtime.core.mesh import MeshPolicy, ProcessMesh
    from elastic_runtime.core.runtime import Component, Runtime
    from elastic_runtime.defaults import ElasticRuntime, under_launch

_HOMES = {
    "elastic_runtime.core.compare": ["compare_states"],
    "elastic_runtime.core.config": ["RuntimeConfig", "load_config"],
    "elastic_runtime.core.context": ["RuntimeContext"],
    "elastic_runtime.core.datasets": ["IndexedBatches"],
    "elastic_runtime.core.eventlog": ["read_events"],
    "elastic_runtime.core.executor": ["RunResult"],
    "elastic_runtime.core.job": ["DataSource", "ProcessBatches", "TrainJob"],
    "elastic_runtime.core.mesh": ["MeshPolicy", "ProcessMesh"],
    "elastic_runtime.core.runtime": ["Component", "Runtime"],
    "elastic_runtime.defaults": ["ElasticRuntime", "under_launch"],
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
    "HandlerContext",
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
    "compare_states",
    "load_config",
    "read_events",
    "under_launch",
    *_event_names,
]

if __name__ != "elastic_runtime":  # this file run under its old import name, `runtime` (compat/old_names.py)
    from elastic_runtime.compat.old_names import redirect

    redirect(__name__)
