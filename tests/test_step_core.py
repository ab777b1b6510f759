"""The step both loops drive (``core/step_core.py``), on real JAX arrays and without a loop around it: what a step
reads, what runs once its results are ready, and the order of a commit. The executor's and a launch worker's tests
(tests/test_recovery.py, tests/test_integrity.py, tests/multiprocess/) run it inside each mode."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest

from elastic_runtime.core.cadence import EveryN
from elastic_runtime.core.job import TrainJob
from elastic_runtime.core.keys import with_key_data
from elastic_runtime.core.ledger import StepLedger
from elastic_runtime.core.step_core import StepCore


class Rows:
    def batch(self, position: int) -> Any:
        return {"x": jnp.full((2,), float(position))}


def step(state: Any, batch: Any) -> tuple[Any, Any]:
    new = {"w": state["w"] + batch["x"].sum()}
    return new, {"loss": new["w"].sum(), "extra": {"norm": jnp.abs(new["w"]).max()}}


def a_core(loss_key: str | tuple[str, ...] = "loss", **policies: Any) -> StepCore:
    made = TrainJob(init=lambda: {"w": jnp.zeros((3,))}, step=step, data=Rows(), loss_key=loss_key)
    job, keys = with_key_data(made)
    return StepCore(job, keys, StepLedger("test", policies=policies))


def test_a_commit_keeps_the_step_in_the_tiers_due_before_the_ledger_moves_on() -> None:
    core = a_core(file=EveryN(2))
    seen: list[tuple[int, tuple[str, ...], float]] = []
    for n in range(1, 5):
        state = {"w": jnp.full((3,), float(n))}

        def keep(due: tuple[str, ...], state: Any = state) -> None:
            # The new results are in place, the step is not committed yet: a reader of the step finds its copies.
            assert core.state is state
            seen.append((core.step, due, core.loss or 0.0))

        noted = core.commit(
            n, state, loss=float(n), metrics={"loss": float(n)}, seconds=0.5, data_position=n, keep=keep
        )
        assert core.step == n and core.data_position == n
        assert noted.due == (("file",) if n % 2 == 0 else ())
    assert seen == [(0, (), 1.0), (1, ("file",), 2.0), (2, (), 3.0), (3, ("file",), 4.0)]
    assert core.productive_s == pytest.approx(2.0) and core.step_s == 0.5


def test_a_step_reads_the_state_through_the_input_faults_and_its_checks_run_once_its_results_are_ready() -> None:
    core = a_core()
    program = jax.jit(step)
    calls: list[tuple[int, tuple[int, ...]]] = []
    core.input_faults.append(lambda n, state: {"w": state["w"] + 100.0} if n == 2 else state)
    core.step_checks.append(lambda at, devices: calls.append((at, devices)))
    state = {"w": jnp.zeros((3,))}
    for n in (1, 2):
        new_state, metrics = core.launch(program, state, n, Rows().batch(n))
        _, loss, scalars = core.results(n, new_state, metrics, (0, 1))
        state = new_state
    # Step 1 adds 2 to each of 3 weights; step 2 reads them 100 higher and adds 4.
    assert loss == pytest.approx(3 * 106.0) and scalars == {"loss": pytest.approx(318.0), "extra/norm": 106.0}
    assert calls == [(1, (0, 1)), (2, (0, 1))]


@pytest.mark.parametrize(("loss_key", "expected"), [(("extra", "norm"), 104.0), ("accuracy", None)])
def test_the_loss_is_the_metric_its_key_names_nested_or_none(loss_key: Any, expected: float | None) -> None:
    core = a_core(loss_key)
    state = {"w": jnp.full((3,), 100.0)}
    new_state, metrics = core.launch(jax.jit(step), state, 2, Rows().batch(2))
    _, loss, scalars = core.results(2, new_state, metrics, (0,))
    assert loss == expected and scalars["extra/norm"] == 104.0  # 100 + the batch's 2 + 2


def test_a_check_that_raises_fails_the_step_and_a_metric_that_is_not_one_number_is_named() -> None:
    core = a_core()

    def refuse(at: int, devices: tuple[int, ...]) -> None:
        raise RuntimeError(f"step {at} on {devices}: wrong result")

    core.step_checks.append(refuse)
    new_state = {"w": jnp.ones((3,))}
    with pytest.raises(RuntimeError, match="step 7 on \\(4,\\): wrong result"):
        core.results(7, new_state, {"loss": jnp.float32(1.0)}, (4,))
    core.step_checks.clear()
    with pytest.raises(ValueError, match="'grad'"):
        core.results(7, new_state, {"loss": jnp.float32(1.0), "grad": jnp.ones((3,))}, (4,))
    assert core.step == 0 and core.state is None  # nothing was committed


def test_a_restore_puts_the_state_in_place_and_moves_the_books_back() -> None:
    core = a_core(file=EveryN(3))
    for n in range(1, 6):
        core.commit(n, {"w": n}, loss=None, metrics={}, seconds=0.1, data_position=10 * n)
    restored = core.restored({"w": 3}, 3, data_position=30, restored_from="ram", seconds=0.2)
    assert (core.state, core.step, core.data_position) == ({"w": 3}, 3, 30)
    assert (restored.step, restored.lost_steps, restored.restored_from) == (3, 2, "ram")
    assert core.ledger.due(4) == () and core.ledger.due(6) == ("file",)  # the cadence counts from the restore


def test_a_transform_is_traced_and_placed_and_one_that_reshapes_is_refused() -> None:
    core = a_core()
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    state = {"w": jnp.arange(3.0)}
    traced: list[bool] = []

    def scale(tree: Any) -> Any:
        traced.append(isinstance(tree["w"], jax.core.Tracer))
        return {"w": tree["w"] * 10}

    new = core.transform(scale, state, {"w": sharding})
    assert list(new["w"]) == [0.0, 10.0, 20.0] and new["w"].sharding == sharding
    assert traced and all(traced)  # the same in one process as in a group: traced with jax.jit
    with pytest.raises(ValueError, match="changed the state's structure, shapes or dtypes"):
        core.transform(lambda tree: {"w": tree["w"][:2]}, state, {"w": sharding})
