"""The shape of the fault-free reference run (``conftest.reference``) that multi-process tests compare with, and
the run itself for tests that need another group size.

A module of its own, because ``from conftest import ...`` finds whichever conftest was imported last.
"""

from pathlib import Path
from typing import Any

from elastic_runtime.cli.demo_multiprocess import run_group
from elastic_runtime.core.events import CheckpointCommitted, StepCompleted

# The runs compared with it must use the same: 3 worker processes x 2 CPU devices, 30 steps of the demo model.
STEPS = 30
NPROCS = 3


def fault_free_final(run_dir: Path, processes: int = NPROCS, steps: int = STEPS) -> Path:
    """A fault-free launched run of the demo job in ``run_dir``; the folder holding its final state (the disk
    tier's format)."""
    result = run_group(processes=processes, steps=steps, run_dir=run_dir, faults=[])
    assert result.ok and result.step == steps and result.recoveries == []
    return run_dir / "final"


def lose_after_durable(controller: Any, position: int) -> list[int]:
    """Kill the member at ``position`` (its host lost) once the durable tier holds a step to go back to and the
    group is 2 steps past it: the workers write that tier in the background, so a fixed step may come before any
    durable step is whole; and at the commit itself the processes' newest steps (and their neighbours' copies)
    may differ by one. Returns the list the durable steps committed are appended to, in order."""
    committed: list[int] = []
    killed: list[int] = []

    async def note(event: CheckpointCommitted, ctx: Any) -> None:
        committed.append(event.step or 0)

    async def lose(event: StepCompleted, ctx: Any) -> None:
        if committed and (event.step or 0) >= committed[0] + 2 and not killed:
            killed.append(event.step or 0)
            ctx.signal(ctx.members[position], "KILL", "test: its host is lost")

    controller.bus.subscribe(CheckpointCommitted, note)
    controller.bus.subscribe(StepCompleted, lose)
    return committed
