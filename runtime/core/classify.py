"""Exception classification: which errors from a step are infrastructure failures, and which are bugs.

Pathways treats a ``JaxRuntimeError`` with status DATA_LOSS, DEADLINE_EXCEEDED, NOT_FOUND or INTERNAL as a
lost slice; a multi-controller group reports a dead peer as ``ProcessFailureError``. Everything else is
the user's own error: it stops the run with a clear message, it is never retried silently.
"""

from __future__ import annotations

from jax.errors import JaxRuntimeError

from runtime.core.events import DeviceLost, Failure, ProcessLost, SliceLost, StepFailed

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
) -> Failure:
    """Turn an exception raised by step ``step`` into its failure event.

    ``lost_devices`` are the mesh devices a health probe found dead after the error; ``slices`` the whole
    slices among them. A slice-down status with whole slices lost is :class:`SliceLost`; otherwise
    :class:`DeviceLost` (possibly with no device named: a transient error, retried on the same devices).
    """
    error_type, message = type(exc).__name__, str(exc)
    if _is_process_failure(exc):
        return ProcessLost(step=step, source="executor", error_type=error_type, message=message)
    if not is_infrastructure_failure(exc):
        return StepFailed(step=step, source="executor", error_type=error_type, message=message)
    status = xla_status(exc)
    if slices and slice_size > 1:
        return SliceLost(
            step=step, source="executor", error_type=error_type, message=message, devices=lost_devices,
            status=status, slices=slices, slice_size=slice_size,
        )  # fmt: skip
    return DeviceLost(
        step=step, source="executor", error_type=error_type, message=message, devices=lost_devices, status=status
    )
