"""Exception classification: which errors from a step are infrastructure failures, and which are bugs.

Pathways treats a ``JaxRuntimeError`` with status DATA_LOSS, DEADLINE_EXCEEDED, NOT_FOUND or INTERNAL as a
lost slice; a multi-controller group reports a dead peer as ``ProcessFailureError``. Everything else is
the user's own error: it stops the run with a clear message, it is never retried silently.

The one classifier of both modes: the single-controller executor and every worker of a multi-process group
(``in_group``) ask it. Exceptions are told apart by type (and an XLA status by its code), never by a message.
"""

from __future__ import annotations

from jax.errors import JaxRuntimeError

from elastic_runtime.core.events import DeviceLost, Failure, ProcessLost, SilentCorruption, SliceLost, StepFailed
from elastic_runtime.core.fingerprint import StateDiverged

SLICE_DOWN_STATUSES = ("DATA_LOSS", "DEADLINE_EXCEEDED", "NOT_FOUND", "INTERNAL")


def xla_status(exc: BaseException) -> str:
    """The status code at the start of an XLA error message (``"DATA_LOSS: ..."``), or ``""``."""
    head = str(exc).split(":", 1)[0].strip()
    return head if head.isupper() and head.replace("_", "").isalpha() else ""


def _is_process_failure(exc: BaseException) -> bool:
    try:
        from jax.experimental.multihost_utils import ProcessFailureError
    except ImportError:  # older JAX: no live_devices API
        return False
    return isinstance(exc, ProcessFailureError)


def is_infrastructure_failure(exc: BaseException) -> bool:
    """True for errors a re-mesh and restore can recover from."""
    if _is_process_failure(exc):
        return True
    return isinstance(exc, JaxRuntimeError) and xla_status(exc) in SLICE_DOWN_STATUSES


def classify(
    exc: BaseException,
    *,
    step: int,
    lost_devices: tuple[int, ...] = (),
    slices: tuple[int, ...] = (),
    slice_size: int = 1,
    in_group: bool = False,
    source: str = "executor",
) -> Failure:
    """Turn an exception raised by step ``step`` into its failure event.

    ``lost_devices`` are the mesh devices a health probe found dead after the error; ``slices`` the whole
    slices among them. A slice-down status with whole slices lost is :class:`SliceLost`; otherwise
    :class:`DeviceLost` (possibly with no device named: a transient error, retried on the same devices).

    ``in_group``: the step ran collectives with other processes (a worker of ``elastic-runtime launch``).
    There any ``JaxRuntimeError`` is :class:`ProcessLost`, whatever its status: a collective whose peer died
    may raise one (rather than hang), and re-forming the group recovers from it.
    """
    error_type, message = type(exc).__name__, str(exc)
    if isinstance(exc, StateDiverged):  # found by the state's fingerprint: no exception of the devices' own
        found = exc.divergence
        return SilentCorruption(
            step=step,
            source=source,
            error_type=error_type,
            message=message,
            suspects=found.suspects,
            digests={str(device): digest for device, digest in found.digests.items()},
            replicas=found.replicas,
            attributed=found.attributed,
            persistent=exc.persistent,
        )
    if _is_process_failure(exc) or (in_group and isinstance(exc, JaxRuntimeError)):
        return ProcessLost(step=step, source=source, error_type=error_type, message=message)
    if not is_infrastructure_failure(exc):
        return StepFailed(step=step, source=source, error_type=error_type, message=message)
    status = xla_status(exc)
    if slices and slice_size > 1:
        return SliceLost(
            step=step, source=source, error_type=error_type, message=message, devices=lost_devices,
            status=status, slices=slices, slice_size=slice_size,
        )  # fmt: skip
    return DeviceLost(
        step=step, source=source, error_type=error_type, message=message, devices=lost_devices, status=status
    )
