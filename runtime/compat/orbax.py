"""The Orbax detail elastic-runtime depends on: the handler name Orbax records in ``_CHECKPOINT_METADATA``.

``elastic_runtime.storage.orbax_layout`` writes Orbax's PyTree layout itself, so it must write the name Orbax would:
Orbax records ``f"{handler.__module__}.{handler.__class__.__qualname__}"`` (``Checkpointer.save`` in
``orbax/checkpoint/_src/checkpointers/checkpointer.py``), a private module path
(``orbax.checkpoint._src.handlers.pytree_checkpoint_handler``) that may move in any release. It is taken
here from the public ``orbax.checkpoint.PyTreeCheckpointHandler`` instead of being spelled out.
"""

from __future__ import annotations

import functools
import importlib

from elastic_runtime.compat.errors import incompatible

SUPPORTED = "0.12"


@functools.cache
def pytree_handler_name() -> str:
    """The handler name Orbax writes for a ``PyTreeCheckpointHandler`` checkpoint (imports Orbax once).

    Raises:
        IncompatibleVersion: ``orbax.checkpoint.PyTreeCheckpointHandler`` is gone.
    """
    where = "orbax.checkpoint.PyTreeCheckpointHandler"
    try:
        ocp = importlib.import_module("orbax.checkpoint")
    except ImportError as exc:
        raise incompatible("orbax-checkpoint", where, f"cannot be imported ({exc})", SUPPORTED) from exc
    handler = getattr(ocp, "PyTreeCheckpointHandler", None)
    if not isinstance(handler, type):
        raise incompatible("orbax-checkpoint", where, "is missing", SUPPORTED)
    return f"{handler.__module__}.{handler.__qualname__}"
