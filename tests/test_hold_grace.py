"""How long a step in flight may still take once the controller speaks (cluster/worker/stepping.py): a drain's hold
lets it finish, a re-forming abandons it soon. Soak seed 6900107: members that abandoned the step a peer finished
held one step behind it, and the drain's final checkpoint had no step every member could write."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any

from elastic_runtime.cluster.protocol import Form, Stop
from elastic_runtime.cluster.worker.stepping import _ABANDON_GRACE_S, _grace


def worker(message: Any, step_time_s: float | None) -> Any:
    inbox: queue.Queue[Any] = queue.Queue()
    inbox.put(message)
    return SimpleNamespace(link=SimpleNamespace(inbox=inbox), core=SimpleNamespace(step_s=step_time_s))


def test_a_hold_lets_the_step_in_flight_finish_a_few_of_its_durations() -> None:
    hold = Stop(reason="SIGTERM", hold=True)
    assert _grace(worker(hold, 0.01)) == 1.0  # at least a second however quick the steps
    assert _grace(worker(hold, 2.0)) == 6.0  # a big model's step: three of them
    assert _grace(worker(hold, None)) == 1.0  # no step timed yet


def test_a_reforming_or_an_exit_abandons_it_soon() -> None:
    form = Form(generation=2, coordinator="127.0.0.1:1", process_id=0, num_processes=2)
    assert _grace(worker(form, 2.0)) == _ABANDON_GRACE_S
    assert _grace(worker(Stop(reason="the run is over"), 2.0)) == _ABANDON_GRACE_S
