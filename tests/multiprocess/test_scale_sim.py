"""Workers lost together are one re-forming, and every survivor is told to form the new group: the supervisor
alone with a clock of the test's, then the real controller (service mode) against simulated workers
(``simworkers.py``)."""

from __future__ import annotations

import asyncio
import secrets
import signal
import subprocess
from pathlib import Path

from simworkers import Fleet, Loss, start_controller
from test_supervisor import Run

from elastic_runtime.cluster.controller.supervision import RegroupRequested, Start
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupForming, WorkerLost


def test_the_supervisor_settles_until_the_workers_that_went_silent_together_are_all_found(tmp_path: Path) -> None:
    run = Run(tmp_path, nprocs=4, spares=0, min_nprocs=2, heartbeat_interval_s=0.5)
    run.service_mode()  # the service mode: workers it does not start, found lost by silence
    run.spawn(4)
    run.feed(Start())
    run.hello(0, 1, 2, 3)
    run.join()
    run.commit(10)  # every heartbeat at t=0
    run.now = 0.3
    for worker in (0, 1, 2):  # worker 3's host is gone; worker 2's goes in the next 0.3 s
        run.monitor.observe(worker, 10)
    run.now = 2.0
    for worker in (0, 1):
        run.monitor.observe(worker, 10)
    run.feed(RegroupRequested(frozenset({3}), "WorkerLost"))  # 3 silent for 2 s: lost
    run.wait(0.1)
    assert len(run.forms) == 1  # worker 2, silent for 1.8 s, may be lost too: not yet
    run.now = 2.3
    run.feed(RegroupRequested(frozenset({2}), "WorkerLost"))
    for worker in (0, 1):
        run.monitor.observe(worker, 10)
    run.wait(0.05)
    assert [f.members for f in run.forms] == [(0, 1, 2, 3), (0, 1)]  # one re-forming for both


N = 32
# Workers 0, 10 and 20 send their heartbeats 0.1 s apart in each 0.5 s interval (simworkers spreads them by id):
# lost together, each is found silent at its own time, 0.2 s apart from first to last.
RACK = (0, 10, 20)


async def lose_a_rack(address: str, secret: str) -> tuple[Fleet, list[int], int]:
    fleet = Fleet(address, secret, interval_s=0.5)
    members = await fleet.start(N)
    await fleet.until(lambda: fleet.told(1, members, restore=True), 60, "the first group formed")
    first, last = (fleet.workers[w].record for w in (RACK[0], RACK[-1]))
    # Lose them just after the last of them sent a heartbeat: their silences then start 0.2 s apart.
    await fleet.until(lambda: 0 < last.last_heartbeat_at - first.last_heartbeat_at < 0.3, 10, "the rack's heartbeats")
    fleet.lose(RACK, Loss.SILENT)
    survivors = [w for w in members if w not in RACK]

    def without_rack() -> int:
        """The newest generation of N - 3 processes every survivor was told to restore in; 0: none yet."""
        sizes = {t.generation: t.processes for t in fleet.workers[survivors[0]].record.forms}
        done = [g for g, size in sizes.items() if size == N - len(RACK) and fleet.told(g, survivors, restore=True)]
        return max(done, default=0)

    await fleet.until(lambda: without_rack() > 0, 60, "the group formed again without the rack")
    generation = without_rack()
    await fleet.close()
    return fleet, survivors, generation


def test_a_rack_lost_at_once_is_one_reforming_and_every_survivor_gets_its_form(tmp_path: Path) -> None:
    secret = secrets.token_hex(32)
    args = ("--min-nprocs", str(N - 4), "--heartbeat-timeout", "1.5", "--max-failures", "100")
    controller, address = start_controller(N, tmp_path, secret, interval_s=0.5, args=args)
    try:
        fleet, survivors, generation = asyncio.run(lose_a_rack(address, secret))
    finally:
        controller.send_signal(signal.SIGTERM)
        try:
            controller.wait(timeout=30)
        except subprocess.TimeoutExpired:
            controller.kill()
    events = read_events(tmp_path / "events.jsonl")
    lost = {e.worker for e in events if isinstance(e, WorkerLost) and e.worker in RACK}
    assert lost == set(RACK)
    forming = [e for e in events if isinstance(e, GroupForming)]
    assert [(e.generation, e.strategy) for e in forming] == [(1, "start"), (2, "reform")], forming
    assert generation == 2 and set(forming[1].members) == set(survivors)
    assert fleet.told(2, survivors)  # every survivor got its Form (and, above, its Restore)
