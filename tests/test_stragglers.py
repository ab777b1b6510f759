"""The controller's choice for a straggler (``cluster/controller/stragglers.py``), from numbers alone: replaced by
a ready spare when its cost over the remaining steps exceeds a re-forming's, kept otherwise, the reason naming the
figures either way. Found by the heartbeat monitor (tests/multiprocess/test_heartbeat.py); acted on under launch in
tests/multiprocess/test_straggler_replaced.py."""

from __future__ import annotations

import pytest

from elastic_runtime.cluster.controller.stragglers import judge_straggler
from elastic_runtime.cluster.worker.pace import Pace


def test_a_straggler_that_costs_more_than_a_re_forming_is_replaced() -> None:
    action, reason = judge_straggler(excess_s=0.25, slowdown=3.0, remaining_steps=120, reform_s=1.5, spare_ready=True)
    assert action == "replace"
    assert "about 30.0 s over the 120 remaining steps" in reason and "re-forming costs about 1.5 s" in reason


def test_near_the_end_it_is_kept_and_the_reason_says_a_re_forming_costs_more() -> None:
    action, reason = judge_straggler(excess_s=0.25, slowdown=3.0, remaining_steps=4, reform_s=1.5, spare_ready=True)
    assert action == "keep" and "about 1.0 s over the 4 remaining steps" in reason and "costs more" in reason


def test_without_a_ready_spare_it_is_kept_and_the_reason_says_so() -> None:
    action, reason = judge_straggler(excess_s=0.25, slowdown=3.0, remaining_steps=1000, reform_s=1.5, spare_ready=False)
    assert action == "keep" and "no spare is ready" in reason


def test_a_run_without_an_end_replaces_any_straggler_it_has_a_spare_for() -> None:
    action, reason = judge_straggler(excess_s=0.01, slowdown=1.6, remaining_steps=None, reform_s=60.0, spare_ready=True)
    assert action == "replace" and "no end set" in reason


def test_a_workers_pace_is_its_iteration_less_its_waits_and_its_roles_writes() -> None:
    pace = Pace()
    pace.record(generation=1, step=5, began=10.0, waited=0.2)
    assert pace.iteration_s is None  # one step says nothing yet
    pace.exclude(0.1)  # a durable write of the first slice
    pace.record(generation=1, step=6, began=10.5, waited=0.3)
    assert pace.iteration_s == pytest.approx(0.5) and pace.outside_s == pytest.approx(0.2)
    pace.record(generation=2, step=7, began=20.0, waited=0.3)  # across a re-forming: not an iteration
    assert pace.iteration_s == pytest.approx(0.5)
