"""Errors in the user's code or shardings end the run with StepError, with the events logged, whether they
surface at trace, compile or run time, in the foreground or in a background compile: never an ExceptionGroup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import pytest
from jax.sharding import PartitionSpec as P

from runtime import ElasticRuntime, MeshPolicy, RunFinished, RuntimeConfig, StepError, StepFailed, TrainJob, read_events
from runtime.testing.demo_model import demo_job


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
