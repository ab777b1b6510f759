"""Errors in the user's code or shardings end the run with StepError, with the events logged, whether they
surface at trace, compile or run time, in the foreground or in a background compile: never an ExceptionGroup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import pytest
from jax.sharding import PartitionSpec as P

from elastic_runtime import (
    ElasticRuntime,
    MeshPolicy,
    RunFinished,
    RuntimeConfig,
    StateTransformed,
    StepCompleted,
    StepError,
    StepFailed,
    TrainJob,
    read_events,
)
from elastic_runtime.testing.demo_model import demo_job


def small(**overrides: Any) -> TrainJob:
    job = demo_job(global_batch=24, features=16, hidden=64)
    values = {"init": job.init, "step": job.step, "data": job.data, "state_specs": job.state_specs}
    return TrainJob(**(values | overrides), batch_spec=job.batch_spec)


def raising_step(state: Any, batch: Any) -> Any:
    raise ValueError("the user's step found a bad value")


CASES = {
    "an axis the mesh lacks": (lambda: small(state_specs=jax.tree.map(lambda _: P("nope"), small().init())), "nope"),
    "a shape the model axis cannot split": (lambda: demo_job(global_batch=24, features=16, hidden=63), "63"),
    "a ValueError in the step's Python code": (lambda: small(step=raising_step), "bad value"),
}


@pytest.mark.parametrize("snapshot_every", [1, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_a_user_error_is_a_step_error_with_its_events_logged(tmp_path: Path, case: str, snapshot_every: int) -> None:
    make_job, named = CASES[case]
    config = RuntimeConfig(run_dir=str(tmp_path), snapshot_every=snapshot_every, scale_up_poll_s=None)
    runtime = ElasticRuntime(make_job(), config=config, mesh_policy=MeshPolicy({"data": 4, "model": 2}))
    with pytest.raises(StepError, match=named) as raised:
        runtime.run(5)
    assert "pinned_host" not in str(raised.value)  # the user's own spec is named, not the runtime's copy
    events = read_events(tmp_path / "events.jsonl")
    failed = [e for e in events if isinstance(e, StepFailed)]
    assert len(failed) == 1 and named in failed[0].message
    assert isinstance(events[-1], RunFinished) and not events[-1].ok and named in events[-1].reason


def counting_job() -> TrainJob:
    """w += 1 a step: exact arithmetic, so a transform's effect can be checked to the bit."""
    import jax.numpy as jnp
    import numpy as np

    class Zeros:
        def batch(self, position: int) -> Any:
            return np.zeros((8, 2), np.float32)

    return TrainJob(
        init=lambda: {"w": jnp.zeros(8, jnp.float32)},
        step=lambda state, batch: ({"w": state["w"] + 1}, {"loss": jnp.sum(batch)}),
        data=Zeros(),
        state_specs=P(),
    )


def transform_at_step_3(tmp_path: Path, fn: Any) -> ElasticRuntime:
    # Events after every step: a command sent by a handler lands a step or two later, well before the end.
    config = RuntimeConfig(run_dir=str(tmp_path), scale_up_poll_s=None, precompile=False, event_batch_s=0)
    runtime = ElasticRuntime(counting_job(), config=config, mesh_policy=MeshPolicy({"data": 8}))

    @runtime.on(StepCompleted)
    async def after_three(event: StepCompleted, ctx: Any) -> None:
        if event.step == 3:
            ctx.transform_state(fn, reason="lower the learning rate")

    return runtime


def test_a_handler_transforms_the_state_at_the_next_boundary(tmp_path: Path) -> None:
    result = transform_at_step_3(tmp_path, lambda s: {"w": s["w"] * 10}).run(30)
    (done,) = [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, StateTransformed)]
    assert done.reason == "lower the learning rate" and 3 <= (done.step or 0) < 30
    k = done.step or 0
    assert list(result.state["w"]) == [k * 10.0 + (30 - k)] * 8  # applied once, to step k's state, then stepped on


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda s: 1 / 0, "ZeroDivisionError"),
        (lambda s: {"w": s["w"][:4]}, "changed the state's structure, shapes or dtypes"),
    ],
)
def test_a_transform_that_raises_or_reshapes_is_a_step_error(tmp_path: Path, fn: Any, message: str) -> None:
    with pytest.raises(StepError, match=message):
        transform_at_step_3(tmp_path, fn).run(30)
    events = read_events(tmp_path / "events.jsonl")
    failed = [e for e in events if isinstance(e, StepFailed)]
    assert len(failed) == 1 and message in f"{failed[0].error_type}: {failed[0].message}"
    assert isinstance(events[-1], RunFinished) and not events[-1].ok
