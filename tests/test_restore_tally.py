"""What a group's restore moved, per tier: the controller's tally of its members' reports, and the run summary's
bandwidth from it (``report``)."""

from __future__ import annotations

from elastic_runtime.analysis.summary import summarize
from elastic_runtime.cluster.controller.supervision import MemberRestored, RestoreTally
from elastic_runtime.core.events import RecoveryCompleted, RunFinished, RunStarted


def test_bytes_add_up_per_tier_and_the_slowest_member_times_each_tier_and_the_collective() -> None:
    tally = RestoreTally()
    tally.add(MemberRestored("ram", 100, read_s=0.01, transfer_s=0.5))
    tally.add(MemberRestored("ram", 300, read_s=0.03, transfer_s=0.2))
    tally.add(MemberRestored("durable", 50, read_s=2.0, transfer_s=0.4))
    tally.add(MemberRestored("none", 0, read_s=0.0, transfer_s=0.9))  # took every shard from the others
    assert tally.bytes_by_tier == {"ram": 400, "durable": 50}
    assert tally.read_s_by_tier == {"ram": 0.03, "durable": 2.0}
    assert tally.transfer_s == 0.9


def test_the_summary_gives_each_tiers_bytes_read_time_and_rate() -> None:
    events = [
        RunStarted(step=0, source="controller", target_steps=10, mesh_shape={"data": 2}, devices=(0, 1, 2, 3)),
        RecoveryCompleted(
            step=8,
            source="controller",
            cause="WorkerLost",
            failed_step=7,
            recovery_s=1.5,
            lost_steps=0,
            restored_from="ram",
            mesh_shape={"data": 2},
            bytes_by_tier={"ram": 50_000_000, "neighbour": 10},
            read_s_by_tier={"ram": 0.1, "neighbour": 0.0},
            transfer_s=0.7,
        ),
        RunFinished(step=10, source="controller", ok=True),
    ]
    [failure] = summarize(events)["failures"]
    assert failure["tiers"] == {
        "ram": {"bytes": 50_000_000, "read_s": 0.1, "mb_per_s": 500.0},
        "neighbour": {"bytes": 10, "read_s": 0.0, "mb_per_s": None},  # nothing read: no rate to give
    }
    assert failure["transfer_s"] == 0.7
