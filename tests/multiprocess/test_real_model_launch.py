"""A job shaped like a real model's under ``launch`` (``elastic_runtime.testing.keyed_model``): typed PRNG keys in the
state, MaxText-style mesh axes (``data`` across slices, ``fsdp`` and ``tensor`` inside one), a step built per
concrete mesh. A killed worker is replaced and the group restores from the other slice, or from the durable
tier; the result is bitwise equal to a fault-free run of the same layout, and every trace in every worker ran
under its own mesh.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from launch_support import lose_after_durable

from elastic_runtime.cli.demo_multiprocess import group_controller, wipe_lost_replicas
from elastic_runtime.cluster.protocol import ENV_STEP_DELAY_S
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupFormed, LikelyMeshesReady, StepCompleted, WorkerKilled
from elastic_runtime.faults.grammar import Fault
from elastic_runtime.storage.disk import DiskTier

STEPS = 24
SCRIPT = Path(__file__).with_name("keyed_train.py")


def run(
    tmp_path: Path,
    name: str,
    *,
    slices: int,
    kill: int | None,
    wipe: bool = False,
    lose: Callable[[Any, int], Any] | None = None,
    **extra: Any,
) -> tuple[Any, list[Any]]:
    """Run the job; ``kill`` is killed at step 10, or when ``lose(controller, kill)`` says (``lose_after_durable``,
    ``lose_once_prepared``)."""
    log = tmp_path / f"{name}.traces.jsonl"
    controller = group_controller(
        processes=4,
        slices=slices,
        steps=STEPS,
        run_dir=tmp_path / name,
        faults=[] if kill is None or lose is not None else [Fault("kill", kill, step=10)],
        replica_dir=str(tmp_path / name / "replicas"),
        command=[sys.executable, str(SCRIPT), "--steps", str(STEPS), "--trace-log", str(log)],
        **extra,
    )
    if wipe:  # the lost worker's replica files go with it: its shards (keys included) come from elsewhere
        wipe_lost_replicas(controller)
    if kill is not None and lose is not None:
        lose(controller, kill)
    result = controller.run()
    return result, [json.loads(line) for line in log.read_text().splitlines()]


def lose_once_prepared(controller: Any, position: int) -> None:
    """Kill the member at ``position`` once every member of the first group said its programs of the group one slice
    smaller are kept (``LikelyMeshesReady``, runtime/cluster/worker/smaller.py)."""
    ready: set[str] = set()
    killed: list[str] = []

    async def lose(event: LikelyMeshesReady, ctx: Any) -> None:
        ready.add(event.source)
        if len(ready) == len(ctx.members) == 4 and not killed:
            killed.append(event.source)
            ctx.signal(ctx.members[position], "KILL", "test: lost once the smaller group is prepared")

    controller.bus.subscribe(LikelyMeshesReady, lose)


def final(run_dir: Path) -> Any:
    return DiskTier(run_dir / "final").latest(None).tree


@pytest.mark.timeout(300)
def test_keys_and_own_axes_under_launch_with_two_slices(tmp_path: Path) -> None:
    result, traces = run(tmp_path, "run", slices=2, kill=1)
    assert result.ok and result.step == STEPS, result.reason
    (recovery,) = result.recoveries
    assert recovery["lost_steps"] == 0 and result.survivor_restarts == 0
    assert traces and all(t["own_mesh"] for t in traces), traces
    # The re-formed group loaded every compiled program kept from the first one (the survivors from memory, the
    # replacement from the file its predecessor wrote): no process traced the user's step a second time.
    events = read_events(tmp_path / "run" / "events.jsonl")
    formed = [e for e in events if isinstance(e, GroupFormed)]
    # The controller's events name the job's own axes, as the workers laid the mesh out.
    assert {e.mesh_shape["fsdp"] for e in events if isinstance(e, StepCompleted)} == {4}
    # The loss, from the job's nested metrics (loss_key is a path), reaches the group's events.
    losses = [e.loss for e in events if isinstance(e, StepCompleted) and e.loss is not None]
    assert len(losses) >= STEPS // 2 and all(math.isfinite(loss) for loss in losses), losses
    assert [f.traced for f in formed][1:] == [0], formed
    # The re-form's join is timed from each Form's arrival: its wait before the join started is a phase of it.
    assert formed[1].phases["wait"] >= 0 and formed[1].phases["leave"] >= 0, formed[1].phases
    # One trace in each of the first group's 4 processes; none in the spare: its warm-up found the kept programs
    # on this host and only brought its backend up, and as the replacement it loaded them.
    assert sorted(Counter(t["pid"] for t in traces).values()) == [1, 1, 1, 1], traces
    # The group's mesh: 2 slices of 2 processes x 2 devices.
    assert {tuple(t["shape"].items()) for t in traces} == {(("data", 2), ("fsdp", 4), ("tensor", 1))}
    reference, _ = run(tmp_path, "reference", slices=2, kill=None)
    assert reference.ok
    assert compare_states(final(tmp_path / "run"), final(tmp_path / "reference"), bitwise=True)["match"]


@pytest.mark.timeout(300)
def test_keys_through_the_durable_tier_with_one_slice(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    result, _ = run(
        tmp_path,
        "run",
        slices=1,
        kill=1,
        wipe=True,
        lose=lose_after_durable,
        durable_dir=str(durable),
        durable_every=5,
        extra_env={ENV_STEP_DELAY_S: "0.2"},  # room for a durable step to commit before the run ends
    )
    assert result.ok and result.step == STEPS, result.reason
    (recovery,) = result.recoveries
    assert "durable" in recovery["restored_from"], recovery
    reference, _ = run(tmp_path, "reference", slices=1, kill=None)
    assert reference.ok
    assert compare_states(final(tmp_path / "run"), final(tmp_path / "reference"), bitwise=True)["match"]


@pytest.mark.timeout(300)
def test_a_group_one_slice_smaller_loads_the_programs_its_members_prepared_and_traces_nothing(tmp_path: Path) -> None:
    # min_nprocs 2 of 4 in 2 slices: the group may go on with one slice, so each member prepares that layout's
    # programs while it trains (runtime/cluster/worker/smaller.py). Process 1 is killed once all four said so
    # (LikelyMeshesReady); no spare is ready within the spawn timeout, so the group re-forms without its slice:
    # processes 2 and 3 alone, on a new backend, in places 0 and 1 (other device ids than they prepared on).
    result, traces = run(
        tmp_path,
        "run",
        slices=2,
        kill=1,
        lose=lose_once_prepared,
        min_nprocs=2,
        spares=0,
        fork_spares=False,
        spawn_timeout_s=0.3,
        extra_env={ENV_STEP_DELAY_S: "1.0"},  # room for the preparation (2-5 s here) before the run ends
    )
    events = read_events(tmp_path / "run" / "events.jsonl")
    killed = [e for e in events if isinstance(e, WorkerKilled)]
    assert killed, "the members did not all prepare the smaller group before the run ended"
    assert result.ok and result.step == STEPS, result.reason
    assert result.world_size_history[:2] == [4, 2], result.world_size_history
    formed = [e for e in events if isinstance(e, GroupFormed)]
    assert formed[1].members == formed[0].members[2:] and formed[1].traced == 0, formed[1]
    smaller = [t for t in traces if t["shape"]["data"] == 1]
    # Traced ahead, once in each of the four processes, under the smaller mesh; never again at the re-form.
    assert sorted(Counter(t["pid"] for t in smaller).values()) == [1, 1, 1, 1], traces
    assert all(t["own_mesh"] for t in traces), traces
    # The loaded programs computed on their new devices what the fault-free run computes, up to the float
    # reassociation of the steps run with the batch split one way fewer.
    reference, _ = run(tmp_path, "reference", slices=2, kill=None)
    assert reference.ok
    compared = compare_states(final(tmp_path / "run"), final(tmp_path / "reference"), bitwise=False, rtol=1e-5)
    assert compared["match"], compared
