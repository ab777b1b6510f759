"""Every scalar the step returns is kept: in StepCompleted.metrics, by name; a non-scalar is a clear error."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest

from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig, StepCompleted, StepError, read_events
from elastic_runtime.core.metrics import scalar_metrics
from elastic_runtime.testing.demo_model import demo_job, train_step


def test_every_leaf_is_named_by_its_path_and_read_as_a_float() -> None:
    metrics = {"loss": jnp.float32(1.5), "scalar": {"learning/lr": jnp.asarray(0.25, jnp.bfloat16)}, "n": 3}
    assert scalar_metrics(metrics) == {"loss": 1.5, "scalar/learning/lr": 0.25, "n": 3.0}
    assert scalar_metrics((jnp.float32(2), True)) == {"0": 2.0, "1": 1.0}


@pytest.mark.parametrize("bad", [jnp.ones(3), "text"])
def test_a_leaf_that_is_not_one_number_is_named_in_the_error(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"the step's metric 'extra/x' is not one number"):
        scalar_metrics({"loss": 1.0, "extra": {"x": bad}})


def with_metrics(extra: Any) -> Any:
    def step(state: Any, batch: Any) -> Any:
        new, metrics = train_step(state, batch)
        return new, {**metrics, **extra(new)}

    return dataclasses.replace(demo_job(global_batch=16, features=8, hidden=16), step=step)


def test_the_steps_accuracy_and_learning_rate_are_in_every_step_completed(tmp_path: Path) -> None:
    job = with_metrics(lambda new: {"accuracy": jnp.mean(new["params"]["w1"] > 0), "lr": jnp.float32(0.01)})
    config = RuntimeConfig(run_dir=str(tmp_path), precompile=False, progress=False)
    ElasticRuntime(job, config=config, mesh_policy=MeshPolicy({"data": 2, "model": 1})).run(4)
    steps = [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, StepCompleted)]
    assert [e.step for e in steps] == [1, 2, 3, 4]
    for event in steps:
        assert set(event.metrics) == {"loss", "accuracy", "lr"}
        assert event.metrics["loss"] == pytest.approx(event.loss) and event.metrics["lr"] == pytest.approx(0.01)
        assert 0.0 <= event.metrics["accuracy"] <= 1.0


def test_a_non_scalar_metric_ends_the_run_at_the_first_step_naming_it(tmp_path: Path) -> None:
    job = with_metrics(lambda new: {"per_row": new["params"]["w1"][0]})
    config = RuntimeConfig(run_dir=str(tmp_path), precompile=False, progress=False)
    with pytest.raises(StepError, match="'per_row' is not one number"):
        ElasticRuntime(job, config=config, mesh_policy=MeshPolicy({"data": 2, "model": 1})).run(4)
    assert not [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, StepCompleted)]
