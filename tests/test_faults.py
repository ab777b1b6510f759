"""Fault injection and fault schedules: the right devices die and return at the right steps and times."""

from __future__ import annotations

import jax
import pytest
from jax.errors import JaxRuntimeError

from elastic_runtime.core.health import DeviceHealth
from elastic_runtime.faults.grammar import format_faults, parse_faults
from elastic_runtime.faults.process import worker_faults_text
from elastic_runtime.testing.faults import FaultInjector, FaultSchedule


def test_a_dead_device_fails_the_step_with_the_status_a_real_runtime_uses() -> None:
    injector = FaultInjector().lose_devices(5, [2, 3], status="DEADLINE_EXCEEDED")
    injector.advance(4)
    injector.check(4, range(8))  # nothing yet
    injector.advance(5)
    with pytest.raises(JaxRuntimeError, match=r"^DEADLINE_EXCEEDED: device\(s\) \[2, 3\] .* step 5"):
        injector.check(5, range(8))
    injector.check(5, [0, 1, 4])  # a mesh without them runs
    assert injector.dead == {2, 3}


def test_repairs_bring_devices_back() -> None:
    injector = FaultInjector().lose_slice(3, slice_index=1, slice_size=2).repair(6, [2, 3])
    injector.advance(3)
    assert injector.dead == {2, 3}
    injector.advance(6)
    assert injector.dead == frozenset()


def test_schedule_text_by_step_and_by_time() -> None:
    schedule = FaultSchedule.parse("lose-slice:3@10, lose-device:0@2.5s, repair-slice:3@20", slice_size=2, devices=8)
    injector = FaultInjector()
    now = [100.0]
    hook = schedule.hook(injector, clock=lambda: now[0])
    hook(1)
    assert injector.dead == frozenset()
    now[0] = 102.6
    hook(2)
    assert injector.dead == {0}
    hook(10)
    assert injector.dead == {0, 6, 7}
    hook(20)
    assert injector.dead == {0}


def test_periodic_random_slices_are_repaired_in_order() -> None:
    schedule = FaultSchedule.every(60, repair_after_s=20, slice_size=2, devices=8, seed=1)
    assert str(schedule) == "lose-slice:random@60s (every 60s), repair-slice:random@80s (every 60s)"
    injector = FaultInjector()
    now = [0.0]
    hook = schedule.hook(injector, clock=lambda: now[0])
    hook(1)
    now[0] = 61
    hook(2)
    lost = injector.dead
    assert len(lost) == 2 and min(lost) % 2 == 0 and max(lost) == min(lost) + 1
    now[0] = 81
    hook(3)
    assert injector.dead == frozenset()
    now[0] = 121  # and again, a minute later
    hook(4)
    assert len(injector.dead) == 2
    now[0] = 141
    hook(5)
    assert injector.dead == frozenset()


@pytest.mark.parametrize(
    "text", ["explode:1@3", "lose-slice:1", "lose-slice:x@3", "lose-slice:1@soon", "lose-slice:-4@3"]
)
def test_bad_schedules_name_the_item(text: str) -> None:
    with pytest.raises(ValueError, match="fault schedule item"):
        FaultSchedule.parse(text, slice_size=2, devices=8)


def test_the_health_probe_leaves_dead_and_cordoned_devices_out_and_compiles_nothing(compiles: list[float]) -> None:
    # The probe runs before the first step of every run: a compile per device there cost 0.4 s at each start.
    jax.clear_caches()  # so that a probe compiled by an earlier test would be compiled again here
    injector = FaultInjector().lose_devices(1, [2, 3])
    injector.advance(1)
    health = DeviceHealth()
    health.checks.append(lambda device_id: not injector.is_dead(device_id))  # what FaultInjector.attach adds
    health.cordon((5,))
    assert [d.id for d in health.healthy()] == [0, 1, 4, 6, 7]
    assert [d.id for d in health.healthy(jax.devices()[4:6])] == [4]
    assert compiles == []


def test_one_grammar_for_device_process_and_worker_faults() -> None:
    text = "lose-slice:3@100, repair-slice:random@90s, kill:1@40, stop:0@20, term:2@forming, hang:1@12, slow:2@20x3"
    faults = parse_faults(text)
    corrupt = parse_faults("corrupt:1@12,corrupt-persistent:0@5", kinds=("worker",))
    [restoring] = parse_faults("kill:0@restoring")
    assert restoring.restoring and not restoring.forming and str(restoring) == "kill:0@restoring"
    assert [(f.action, f.target, f.step) for f in corrupt] == [("corrupt", 1, 12), ("corrupt-persistent", 0, 5)]
    assert [(f.kind, f.action, f.target) for f in faults] == [
        ("device", "lose-slice", 3),
        ("device", "repair-slice", -1),
        ("process", "kill", 1),
        ("process", "stop", 0),
        ("process", "term", 2),
        ("worker", "hang", 1),
        ("worker", "slow", 2),
    ]
    assert faults[1].seconds == 90 and faults[4].forming and faults[5].step == 12
    assert (faults[6].step, faults[6].factor) == (20, 3.0)
    assert parse_faults(format_faults(faults)) == faults  # the text form reads back
    assert worker_faults_text(faults, 1) == "hang:1@12" and worker_faults_text(faults, 0) == ""


@pytest.mark.parametrize(
    ("text", "kinds", "message"),
    [
        ("kill:1@40", ("device",), "action must be one of lose-slice"),
        ("lose-slice:1@40", ("process", "worker"), "action must be one of kill"),
        ("kill:random@4", ("process",), "kill:random@4"),
        ("hang:1@forming", ("worker",), "hang:1@forming"),
        ("hang:1@restoring", ("worker",), "hang:1@restoring"),
        ("kill:1@-3", ("process",), "step must be >= 0"),
        ("slow:1@20", ("worker",), "STEPxFACTOR"),
        ("slow:1@20x0.5", ("worker",), "a factor > 1"),
    ],
)
def test_a_fault_outside_its_kinds_or_malformed_is_refused(text: str, kinds: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_faults(text, kinds=kinds)
