"""The shape of the fault-free reference run (``conftest.reference``) that multi-process tests compare with, and
the run itself for tests that need another group size.

A module of its own, because ``from conftest import ...`` finds whichever conftest was imported last.
"""

from pathlib import Path

from runtime.cli.demo_multiprocess import run_group

# The runs compared with it must use the same: 3 worker processes x 2 CPU devices, 30 steps of the demo model.
STEPS = 30
NPROCS = 3


def fault_free_final(run_dir: Path, processes: int = NPROCS, steps: int = STEPS) -> Path:
    """A fault-free launched run of the demo job in ``run_dir``; the folder holding its final state (the disk
    tier's format)."""
    result = run_group(processes=processes, steps=steps, run_dir=run_dir, faults=[])
    assert result.ok and result.step == steps and result.recoveries == []
    return run_dir / "final"
