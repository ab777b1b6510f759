"""Snapshot cadence: fixed, or the Young-Daly interval for an expected failure rate; a sparse snapshot still
restores exactly."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import pytest

from elastic_runtime import (
    CheckpointFailed,
    ElasticRuntime,
    MeshPolicy,
    RecoveryCompleted,
    RuntimeConfig,
    StepCompleted,
    read_events,
)
from elastic_runtime.core.cadence import SnapshotCadence
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.snapshot import RamTier
from elastic_runtime.testing import FaultInjector
from elastic_runtime.testing.demo_model import demo_job


def test_a_fixed_cadence_snapshots_every_k_steps_and_counts_from_a_restart() -> None:
    cadence = SnapshotCadence(3)
    due, last = [], 0  # the last save, as the step ledger keeps it
    for step in range(1, 10):
        if cadence.should_save(step, last):
            due.append(step)
            last = step
            cadence.copied(0.001)
    assert due == [3, 6, 9] and cadence.every == 3  # no MTBF: measurements change nothing
    last = 4  # restarted from step 4
    assert not cadence.should_save(6, last) and cadence.should_save(7, last)


def test_with_an_mtbf_the_cadence_is_the_young_daly_interval_in_steps() -> None:
    cadence = SnapshotCadence(1, mtbf_s=60.0)
    assert cadence.should_save(1, 0)
    cadence.stepped(0.01)
    cadence.copied(0.002)  # of step 1
    assert cadence.every == round(math.sqrt(2 * 0.002 * 60.0) / 0.01)  # 0.49 s of training: 49 steps
    assert not cadence.should_save(49, 1) and cadence.should_save(50, 1)
    for _ in range(50):  # the copy got cheaper: snapshots come more often
        cadence.stepped(0.01)
        cadence.copied(0.0005)
    assert cadence.every == round(math.sqrt(2 * 0.0005 * 60.0) / 0.01)


@pytest.mark.parametrize(("every", "mtbf"), [(0, None), (1, 0.0), (1, -5.0)])
def test_impossible_cadences_are_refused(every: int, mtbf: float | None) -> None:
    with pytest.raises(ValueError):
        SnapshotCadence(every, mtbf)


@pytest.mark.parametrize(
    ("cadence", "snapshotted"),
    [
        # A fixed cadence: every third step; the fault at step 20 goes back to step 18.
        ({"snapshot_every": 3}, [3, 6, 9, 12, 15, 18]),
        # An MTBF of a day makes the interval minutes long: only the first three steps are snapshotted (the
        # first run of the step is no measure; step 3 is dispatched before step 2's copy is measured), and
        # the fault goes back to step 3.
        ({"snapshot_mtbf_s": 86400.0}, [1, 2, 3]),
    ],
)
@pytest.mark.usefixtures("copied_snapshots")  # the Young-Daly interval is planned by what a copy costs
def test_a_sparse_snapshot_restores_exactly_and_the_redone_steps_are_counted(
    tmp_path: Path, cadence: dict[str, float], snapshotted: list[int]
) -> None:
    job = lambda: demo_job(global_batch=24, features=16, hidden=64)  # noqa: E731
    policy = MeshPolicy({"data": 4, "model": 1}, global_batch=24)  # 4 spare devices: the mesh keeps its shape
    steps, fault = 40, 20
    reference = ElasticRuntime(job(), config=RuntimeConfig(precompile=False), mesh_policy=policy).run(steps)
    config = RuntimeConfig(run_dir=str(tmp_path), scale_up_poll_s=None, precompile=False, **cadence)
    injector = FaultInjector().lose_devices(fault, [2])
    result = injector.attach(ElasticRuntime(job(), config=config, mesh_policy=policy)).run(steps)
    events = read_events(tmp_path / "events.jsonl")
    completed = [e for e in events if isinstance(e, StepCompleted)]
    restored = snapshotted[-1]
    assert [e.step for e in completed if e.snapshot and e.step < fault] == snapshotted
    [recovery] = [e for e in events if isinstance(e, RecoveryCompleted)]
    assert (recovery.failed_step, recovery.restored_from) == (fault, "ram")
    assert recovery.lost_steps == fault - 1 - restored
    assert [e.step for e in completed] == [*range(1, fault), *range(restored + 1, steps + 1)]  # none skipped
    assert compare_states(result.state, reference.state, bitwise=True)["match"]


@pytest.mark.usefixtures("copied_snapshots")
def test_a_snapshot_every_step_is_copied_inside_the_step_and_a_sparser_one_behind_it(tmp_path: Path) -> None:
    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=24)
    for every in (1, 2):
        run_dir = tmp_path / str(every)
        config = RuntimeConfig(run_dir=str(run_dir), snapshot_every=every, scale_up_poll_s=None, precompile=False)
        runtime = ElasticRuntime(demo_job(global_batch=24, features=16, hidden=64), config=config, mesh_policy=policy)
        result = runtime.run(6)
        completed = [e for e in read_events(run_dir / "events.jsonl") if isinstance(e, StepCompleted)]
        snapshotted = [e for e in completed if e.snapshot]
        assert [e.step for e in snapshotted] == list(range(every, 7, every))
        # Every step: compiled into the step, which waits for nothing after it. Sparser: a copy of its own,
        # queued behind the due step; what it added is estimated (>= 0), and the step's time is net of it.
        assert runtime.executor.compiler is not None and runtime.executor.compiler.host_copy == (every == 1)
        assert all(e.snapshot_wait_s >= 0.0 for e in snapshotted)
        if every == 1:
            assert all(e.snapshot_wait_s == 0.0 for e in snapshotted)
        latest = runtime.executor.ram.latest()
        assert latest.step == 6 and compare_states(latest.tree, result.state, bitwise=True)["match"]


@pytest.mark.parametrize("every", [1, 3])
def test_on_cpu_devices_a_snapshot_is_the_state_itself_and_restores_exactly(tmp_path: Path, every: int) -> None:
    job = lambda: demo_job(global_batch=24, features=16, hidden=64)  # noqa: E731
    policy = MeshPolicy({"data": 4, "model": 1}, global_batch=24)
    steps, fault = 12, 8
    reference = ElasticRuntime(job(), config=RuntimeConfig(precompile=False), mesh_policy=policy).run(steps)
    # No disk tier: nothing reads the last snapshot (into numpy) as the run ends.
    config = RuntimeConfig(
        run_dir=str(tmp_path), checkpoint_dir="", snapshot_every=every, scale_up_poll_s=None, precompile=False
    )
    runtime = FaultInjector().lose_devices(fault, [2]).attach(ElasticRuntime(job(), config=config, mesh_policy=policy))
    result = runtime.run(steps)
    executor = runtime.executor
    assert executor.compiler is not None and not executor.compiler.host_copy  # no copy compiled into the step
    latest = executor.ram.latest()
    held = latest.unread()
    assert latest.step == steps and held is not None
    assert all(a is b for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(executor.core.state), strict=True))
    [recovery] = [e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, RecoveryCompleted)]
    restored = (fault - 1) // every * every
    assert (recovery.restored_from, recovery.lost_steps) == ("ram", fault - 1 - restored)
    assert compare_states(result.state, reference.state, bitwise=True)["match"]


@pytest.mark.usefixtures("copied_snapshots")
def test_a_copy_that_fails_behind_its_step_is_reported_and_the_step_still_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dispatch = RamTier.dispatch_copy

    def broken_at_step_4(self: RamTier, state: Any, *, step: int) -> Any:
        host = dispatch(self, state, step=step)
        if step == 4:  # the copy's arrays are gone by the time it is awaited, as with a lost device
            jax.tree.map(lambda a: a.delete(), host)
        return host

    monkeypatch.setattr(RamTier, "dispatch_copy", broken_at_step_4)
    config = RuntimeConfig(run_dir=str(tmp_path), snapshot_every=2, scale_up_poll_s=None, precompile=False)
    job = demo_job(global_batch=24, features=16, hidden=64)
    runtime = ElasticRuntime(job, config=config, mesh_policy=MeshPolicy({"data": 4, "model": 1}, global_batch=24))
    result = runtime.run(5)
    events = read_events(tmp_path / "events.jsonl")
    assert [(e.step, e.tier) for e in events if isinstance(e, CheckpointFailed)] == [(4, "ram")]
    completed = {e.step: e for e in events if isinstance(e, StepCompleted)}
    assert sorted(completed) == [1, 2, 3, 4, 5] and result.step == 5
    assert [s for s, e in completed.items() if e.snapshot] == [2]
    assert runtime.executor.ram.latest().step == 2  # the failed copy did not replace the good one


def test_with_an_mtbf_a_copy_measured_free_still_leaves_steps_to_measure_it_against() -> None:
    cadence = SnapshotCadence(1, mtbf_s=1.0)
    cadence.stepped(1.0)
    cadence.copied(-0.001)  # step noise made the snapshotted step look faster than the average
    assert cadence.every == 2


@pytest.mark.usefixtures("copied_snapshots")
def test_the_cadence_learns_from_warm_steps_and_copies_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: list[float]
) -> None:
    # A compile or an executable's first run counted as a step or a copy skews the Young-Daly interval, and
    # it recovers slowly: one copy measured with its compile (2 s) set the next snapshot 1600 steps away.
    stepped: list[float] = []
    measure = SnapshotCadence.stepped
    monkeypatch.setattr(SnapshotCadence, "stepped", lambda self, s: (stepped.append(s), measure(self, s)))
    compiled_in_copy: list[int] = []
    dispatch = RamTier.dispatch_copy

    def counting(self: RamTier, state: Any, *, step: int) -> Any:
        before = len(compiles)
        host = dispatch(self, state, step=step)
        compiled_in_copy.append(len(compiles) - before)
        return host

    monkeypatch.setattr(RamTier, "dispatch_copy", counting)
    jax.clear_caches()  # the copy's compile must happen in this run, whatever ran before
    config = RuntimeConfig(run_dir=str(tmp_path), snapshot_every=3, scale_up_poll_s=None, precompile=False)
    job = demo_job(global_batch=24, features=16, hidden=64)
    ElasticRuntime(job, config=config, mesh_policy=MeshPolicy({"data": 4, "model": 2}, global_batch=24)).run(8)
    completed = {e.step: e for e in read_events(tmp_path / "events.jsonl") if isinstance(e, StepCompleted)}
    assert compiled_in_copy == [0, 0]  # steps 3 and 6: compiled before the step's time starts
    assert stepped == [completed[step].duration_s for step in (2, 4, 5, 7, 8)]  # not step 1, the first run
