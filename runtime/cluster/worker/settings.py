"""A worker's settings, read once from the environment the controller (or the cluster) starts it with.

Every ``ELASTIC_*`` variable a worker reads is a field here, with its default and its range; nothing else in
the worker reads the environment. A bad value is a clear error naming the variable, before anything starts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import msgspec

from elastic_runtime.cluster.protocol import (
    ENV_COMPILE_CACHE,
    ENV_CONNECT_S,
    ENV_CONTROLLER,
    ENV_GRACE_S,
    ENV_HEARTBEAT_S,
    ENV_INSTANCE,
    ENV_JAX_HEARTBEAT_S,
    ENV_JAX_INIT_S,
    ENV_JAX_SHUTDOWN_S,
    ENV_KEEP_PROGRAMS,
    ENV_LOCAL_DEVICES,
    ENV_METADATA_HOST,
    ENV_PREPARE_SMALLER,
    ENV_REPLICA_DIR,
    ENV_RESULT,
    ENV_RETURN_FREED_MEMORY,
    ENV_RUN_ID,
    ENV_SPARE_STATES,
    ENV_STEP_DELAY_S,
    ENV_WORKER,
)
from elastic_runtime.core.config import NonNegative, Positive, Seconds, SecondsOrZero, check_ranges
from elastic_runtime.core.errors import ConfigError

__all__ = ["WorkerSettings"]

# field -> the variable it is read from
_VARIABLES = {
    "controller": ENV_CONTROLLER,
    "worker": ENV_WORKER,
    "replica_dir": ENV_REPLICA_DIR,
    "local_devices": ENV_LOCAL_DEVICES,
    "result": ENV_RESULT,
    "run_id": ENV_RUN_ID,
    "heartbeat_s": ENV_HEARTBEAT_S,
    "jax_init_s": ENV_JAX_INIT_S,
    "jax_heartbeat_s": ENV_JAX_HEARTBEAT_S,
    "jax_shutdown_s": ENV_JAX_SHUTDOWN_S,
    "compile_cache": ENV_COMPILE_CACHE,
    "connect_s": ENV_CONNECT_S,
    "step_delay_s": ENV_STEP_DELAY_S,
    "keep_programs": ENV_KEEP_PROGRAMS,
    "prepare_smaller": ENV_PREPARE_SMALLER,
    "return_freed_memory": ENV_RETURN_FREED_MEMORY,
    "spare_states": ENV_SPARE_STATES,
    "instance": ENV_INSTANCE,
    "metadata_host": ENV_METADATA_HOST,
    "grace_s": ENV_GRACE_S,
}


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker process is told by its environment. Build it with :meth:`from_env`."""

    controller: str  # host:port of the controller
    worker: NonNegative  # this process's worker id (unique for the run, never reused)
    replica_dir: str = ""  # where replica files live; "": /dev/shm/elastic-runtime-<parent pid>
    local_devices: Positive = 2  # CPU devices per process
    result: str = ""  # a folder where process 0 commits the final state; "": none
    run_id: str = ""  # the run's id ("": it comes with the first Form)
    heartbeat_s: Seconds = 0.2
    jax_init_s: Positive = 60  # jax.distributed's initialization timeout
    # Ours detect a loss in ~2 s; JAX's own (default 100 s) must not fire first and end the group.
    jax_heartbeat_s: Positive = 30
    # JAX's default 300 s: a shutdown that waited for a dead peer would stall the re-forming for minutes.
    jax_shutdown_s: Positive = 2
    compile_cache: str = ""  # the persistent XLA cache the workers share; "": none
    connect_s: Seconds = 120.0  # how long to try to reach the controller
    step_delay_s: SecondsOrZero = 0.0  # extra sleep per step (tests: room to kill mid-run)
    keep_programs: bool = True  # load compiled programs kept from earlier generations (runtime/core/programs.py)
    # Compile the programs of the group one slice smaller while training, where it may form (worker/smaller.py).
    prepare_smaller: bool = True
    return_freed_memory: bool = True  # glibc maps large blocks apart and returns them (runtime/core/memory.py)
    spare_states: bool = True  # a step writes its new state into a replaced one (runtime/cluster/worker/spares.py)
    instance: str = ""  # the instance (host) it runs on; "": found by runtime/cluster/worker/instance.py
    metadata_host: str = ""  # host:port of a metadata server to ask for the instance's name; "": none
    # After SIGTERM/SIGINT, how long to wait for the controller's Stop before exiting unasked (Kubernetes gives
    # 30 s by default before its SIGKILL: the rest is for the exit itself).
    grace_s: Seconds = 25.0

    def __post_init__(self) -> None:
        check_ranges(self, origin="worker settings")  # the same ranges for settings built in code

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerSettings:
        """Read the worker's variables from ``environ``.

        Raises:
            ConfigError: a variable is missing (the controller's address, the worker id) or out of range,
                naming the variable and its value.
        """
        values = {field: environ[name] for field, name in _VARIABLES.items() if environ.get(name, "") != ""}
        try:
            return msgspec.convert(values, cls, strict=False)
        except msgspec.ValidationError as exc:
            found = re.search(r"\$\.(\w+)", str(exc)) or re.search(r"field `(\w+)`", str(exc))
            field = found.group(1) if found else ""
            shown = f"={values[field]!r}" if field in values else " is not set"
            raise ConfigError(f"worker environment: {_VARIABLES.get(field, field)}{shown}: {exc}") from exc

    def replica_folder(self, parent_pid: int) -> str:
        """Where this worker's replica files live."""
        return self.replica_dir or f"/dev/shm/elastic-runtime-{parent_pid}"
