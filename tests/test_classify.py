"""Exception classification: Pathways' slice-down statuses recover, everything else is the user's error."""

from __future__ import annotations

import pytest
from jax.errors import JaxRuntimeError
from jax.experimental.multihost_utils import ProcessFailureError

from elastic_runtime.core.classify import SLICE_DOWN_STATUSES, classify, is_infrastructure_failure, xla_status
from elastic_runtime.core.events import DeviceLost, ProcessLost, SliceLost, StepFailed


@pytest.mark.parametrize("status", SLICE_DOWN_STATUSES)
def test_slice_down_statuses_are_device_loss(status: str) -> None:
    exc = JaxRuntimeError(f"{status}: something went away")
    assert xla_status(exc) == status
    event = classify(exc, step=12, lost_devices=(3,))
    assert type(event) is DeviceLost
    assert event.status == status and event.devices == (3,) and event.step == 12
    assert event.error_type == "JaxRuntimeError" and "went away" in event.message


def test_whole_slices_lost_are_slice_lost() -> None:
    exc = JaxRuntimeError("DATA_LOSS: slice gone")
    event = classify(exc, step=5, lost_devices=(6, 7), slices=(3,), slice_size=2)
    assert isinstance(event, SliceLost) and event.slices == (3,) and event.slice_size == 2


@pytest.mark.parametrize(
    "exc",
    [
        JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory allocating 4GiB"),
        JaxRuntimeError("INVALID_ARGUMENT: shapes differ"),
        ValueError("user bug"),
        ZeroDivisionError("division by zero"),
        RuntimeError("DATA_LOSS lookalike without the XLA error type"),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:20]}",
)
def test_other_errors_are_step_failed(exc: Exception) -> None:
    assert not is_infrastructure_failure(exc)
    event = classify(exc, step=1)
    assert type(event) is StepFailed
    assert event.error_type == type(exc).__name__ and event.message == str(exc)


def test_process_failure_is_process_lost() -> None:
    event = classify(ProcessFailureError("peer 2 died"), step=4)
    assert isinstance(event, ProcessLost) and event.step == 4


def test_status_parsing_ignores_prose() -> None:
    assert xla_status(ValueError("no status here")) == ""
    assert xla_status(ValueError("Data loss: lower case is not a status")) == ""


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        # A collective whose peer died can raise any status: in a group the group re-forms, nothing is the user's.
        (JaxRuntimeError("INVALID_ARGUMENT: gloo connection reset"), ProcessLost),
        (JaxRuntimeError("DATA_LOSS: peer gone"), ProcessLost),
        (ProcessFailureError("peer 1 died"), ProcessLost),
        # The user's own errors end the run in a group as they do in one process.
        (ValueError("user bug"), StepFailed),
        (RuntimeError("DATA_LOSS lookalike without the XLA error type"), StepFailed),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:20]}" if isinstance(e, BaseException) else e.__name__,
)
def test_in_a_group_any_jax_runtime_error_is_the_groups(exc: Exception, expected: type) -> None:
    event = classify(exc, step=7, in_group=True, source="worker-3")
    assert type(event) is expected
    assert event.step == 7 and event.source == "worker-3" and event.error_type == type(exc).__name__


def test_outside_a_group_the_same_error_is_the_users() -> None:
    assert type(classify(JaxRuntimeError("INVALID_ARGUMENT: gloo connection reset"), step=7)) is StepFailed
