"""The private JAX and jaxlib entry points elastic-runtime uses, each checked on use.

The multi-process mode hosts each generation's coordination service in the controller and connects the
workers to it itself, because ``jax.distributed.initialize`` would host it in process 0 (whose loss then
ends every survivor) and passes no ``shutdown_timeout`` to the client. No public API does this in jax 0.10
to 0.12: ``jax.distributed`` exports only ``initialize``, ``is_initialized`` and ``shutdown``, so this
module reaches, as ``initialize`` itself does, into ``jax._src.distributed.global_state`` and jaxlib's
``get_distributed_runtime_client`` and ``get_distributed_runtime_service``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from elastic_runtime.compat.errors import incompatible

SUPPORTED = "0.10-0.12"
_STATE_FIELDS = ("client", "coordinator_address", "process_id", "num_processes")


def _private(module: str, path: str, distribution: str = "jax") -> Any:
    """``module`` imported, then the dotted attribute ``path`` looked up on it."""
    where = f"{module}.{path}"
    try:
        found: Any = importlib.import_module(module)
    except ImportError as exc:
        raise incompatible(distribution, where, f"cannot be imported ({exc})", SUPPORTED) from exc
    for name in path.split("."):
        if not hasattr(found, name):
            raise incompatible(distribution, where, "is missing", SUPPORTED)
        found = getattr(found, name)
    return found


def _call(distribution: str, where: str, function: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except TypeError as exc:  # nanobind's "incompatible function arguments": the signature changed
        raise incompatible(distribution, where, f"changed its arguments ({exc})", SUPPORTED) from exc


def distributed_state() -> Any:
    """JAX's process-wide distributed state (``jax._src.distributed.global_state``).

    The worker sets ``client``, ``coordinator_address``, ``process_id`` and ``num_processes`` on it, as
    ``jax.distributed.initialize`` does, so that ``jax.devices()`` and ``multihost_utils`` see the group.

    Raises:
        IncompatibleVersion: the state object, or one of those fields, is gone.
    """
    state = _private("jax._src.distributed", "global_state")
    for field in _STATE_FIELDS:
        if not hasattr(state, field):
            raise incompatible("jax", f"jax._src.distributed.global_state.{field}", "is missing", SUPPORTED)
    return state


def distributed_runtime_client(
    coordinator: str,
    process_id: int,
    *,
    init_timeout: int,
    use_compression: bool,
    heartbeat_timeout: int,
    shutdown_timeout: int,
) -> Any:
    """A coordination-service client for ``process_id``, not yet connected (jaxlib's
    ``_jax.get_distributed_runtime_client``, which ``jax.distributed.initialize`` calls). Timeouts in seconds.

    Raises:
        IncompatibleVersion: the function is gone or no longer takes these arguments.
    """
    where = "jax._src.lib._jax.get_distributed_runtime_client"
    function = _private("jax._src.lib", "_jax.get_distributed_runtime_client", "jaxlib")
    return _call(
        "jaxlib",
        where,
        function,
        coordinator,
        process_id,
        init_timeout=init_timeout,
        use_compression=use_compression,
        heartbeat_timeout=heartbeat_timeout,
        shutdown_timeout=shutdown_timeout,
    )


def distributed_runtime_service(
    address: str, num_processes: int, *, heartbeat_timeout: int, shutdown_timeout: int, recoverable: bool
) -> Any:
    """A running coordination service on ``address`` for ``num_processes`` tasks (jaxlib's
    ``_jax.get_distributed_runtime_service``, which ``jax.distributed.initialize`` calls in process 0).
    Timeouts in seconds; ``recoverable``: a task that disappears is not an error for the others.

    Raises:
        IncompatibleVersion: the function is gone or no longer takes these arguments.
    """
    where = "jaxlib._jax.get_distributed_runtime_service"
    # From jaxlib's extension itself, not through jax._src.lib: the controller hosts the service and never
    # imports JAX (0.08 s against 1 s). JAX's own import quiets XLA's INFO lines first; so does this.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    function = _private("jaxlib._jax", "get_distributed_runtime_service", "jaxlib")
    return _call(
        "jaxlib",
        where,
        function,
        address,
        num_processes,
        heartbeat_timeout=heartbeat_timeout,
        shutdown_timeout=shutdown_timeout,
        recoverable=recoverable,
    )


def load_executable_onto(serialized: bytes, in_tree: Any, out_tree: Any, moved: dict[int, Any]) -> Any:
    """A serialized executable (``jax.experimental.serialize_executable.serialize``) loaded to run on other
    devices: each device id in it replaced by ``moved[id]``, in the same logical place.

    ``deserialize_and_load`` keeps the device assignment the executable was compiled with: its
    ``execution_devices`` only looks the same ids up. So this unpickles with JAX's own unpickler, the devices
    swapped, and hands the executable to the client with compile options that carry the new assignment
    (``Client.deserialize_executable``'s ``compile_options``).

    Raises:
        IncompatibleVersion: the unpickler or the client's method is gone or changed.
    """
    import io

    import jax
    import numpy as np

    unpickler: Any = _private("jax.experimental.serialize_executable", "_JaxPjrtUnpickler")
    xc: Any = _private("jax._src.lib", "xla_client", "jaxlib")
    devices = list(moved.values())
    backend = devices[0].client

    class _Executable:  # the executable's bytes, loaded once the device assignment is known
        def __init__(self, payload: bytes) -> None:
            self.payload = payload

    class _Onto(unpickler):
        def persistent_load(self, pid: Any) -> Any:
            if pid[0] == "device":
                return moved[pid[1]]
            if pid[0] == "exec":
                return _Executable(pid[1])
            return super().persistent_load(pid)

    where = "jax.experimental.serialize_executable._JaxPjrtUnpickler"
    unloaded, args_info, no_kwargs = _call("jax", where, _Onto, io.BytesIO(serialized), backend, devices).load()
    assignment = list(unloaded.device_list)  # the executable's devices in their logical order, moved
    options = xc.CompileOptions()
    options.num_replicas, options.num_partitions = 1, len(assignment)
    options.device_assignment = xc.DeviceAssignment.create(np.array([[d.id for d in assignment]]))
    where = "jaxlib Client.deserialize_executable"
    unloaded.xla_executable = _call(
        "jaxlib",
        where,
        backend.deserialize_executable,
        unloaded.xla_executable.payload,
        xc.DeviceList(tuple(assignment)),
        compile_options=options,
    )
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info), out_tree, no_kwargs=no_kwargs)
