"""Silent data corruption under launch: the slices' copies of the state are compared after every step, before it
commits (a digest per device, gathered by every member: the same verdict in each). A bit flipped once in one
worker's copy is found at the next step and healed by the members' replay of it (nothing re-formed, nothing
lost); a worker whose copy goes wrong at every step is found again in the replay and replaced by a spare, and
the group restores the last step that was committed (never the corrupted one). Both end bitwise equal to a
fault-free run, which raises no false alarm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic_runtime.cli.demo_multiprocess import run_group, worker_command
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import CorruptionHealed, GroupFormed, SilentCorruption, WorkerKilled
from elastic_runtime.faults.grammar import Fault
from elastic_runtime.storage.disk import DiskTier

STEPS = 24

pytestmark = pytest.mark.timeout(300)


def launched(root: Path, faults: list[Fault], *, processes: int = 2) -> tuple[Any, list[Any], Any]:
    """A run of ``processes`` slices of one process each, fingerprinted, with ``faults``: its result, events and
    final state."""
    command = worker_command(STEPS, fingerprint=True)
    result = run_group(processes=processes, steps=STEPS, run_dir=root, faults=faults, command=command, spares=2)
    assert result.ok and result.step == STEPS, result.reason
    return result, read_events(root / "events.jsonl"), DiskTier(root / "final").latest(None).tree


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    _, events, state = launched(tmp_path_factory.mktemp("reference"), [])
    assert not [e for e in events if isinstance(e, SilentCorruption)]  # no false alarm
    return state


def test_a_bit_flipped_in_one_workers_copy_is_found_at_the_next_step_and_replayed_bitwise(
    tmp_path: Path, reference: Any
) -> None:
    result, events, state = launched(tmp_path, [Fault("corrupt", 1, step=12)])
    [found] = [e for e in events if isinstance(e, SilentCorruption)]
    [healed] = [e for e in events if isinstance(e, CorruptionHealed)]
    first = next(e for e in events if isinstance(e, GroupFormed))
    assert found.step == 13 and not found.persistent and not found.attributed  # two slices: no majority
    assert first.members[1] in found.workers and len(found.workers) == 2
    assert healed.kind == "transient" and healed.step == 13 and healed.evicted == ()
    assert result.recoveries == [] and result.world_size_history == [2]  # healed in place: no re-forming
    assert compare_states(state, reference, bitwise=True)["match"]


def test_a_worker_whose_copy_goes_wrong_at_every_step_is_replaced_and_nothing_corrupted_is_kept(
    tmp_path: Path, reference: Any
) -> None:
    result, events, state = launched(tmp_path, [Fault("corrupt-persistent", 1, step=12)])
    first, again = [e for e in events if isinstance(e, SilentCorruption)]
    assert first.step == again.step == 13 and not first.persistent and again.persistent  # the replay differed too
    killed = {e.worker for e in events if isinstance(e, WorkerKilled)}
    assert killed == set(again.workers)  # with two slices both suspects go: neither can be told right
    [healed] = [e for e in events if isinstance(e, CorruptionHealed)]
    assert healed.kind == "persistent" and set(healed.evicted) == set(again.suspects)
    _, formed = [e for e in events if isinstance(e, GroupFormed)]
    assert formed.restore_step <= 12 and not killed & set(formed.members)  # the last committed step, or before
    assert result.world_size_history == [2, 2]  # spares took both seats: the original mesh, so bitwise
    assert compare_states(state, reference, bitwise=True)["match"]


@pytest.mark.heavy
def test_with_three_slices_the_majority_names_the_one_worker_and_only_it_is_replaced(tmp_path: Path) -> None:
    result, events, state = launched(tmp_path / "run", [Fault("corrupt-persistent", 1, step=12)], processes=3)
    first = next(e for e in events if isinstance(e, GroupFormed))
    again = [e for e in events if isinstance(e, SilentCorruption)][-1]
    assert again.persistent and again.attributed and again.workers == (first.members[1],)
    assert {e.worker for e in events if isinstance(e, WorkerKilled)} == {first.members[1]}
    assert sum(r["lost_steps"] for r in result.recoveries) == 0  # the others' RAM held step 12 whole
    _, _, want = launched(tmp_path / "reference", [], processes=3)
    assert compare_states(state, want, bitwise=True)["match"]
