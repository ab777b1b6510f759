"""The fault-free run every multi-process test compares with, made once per session (a launch costs ~10 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_support import NPROCS, STEPS

from runtime.cli.demo_multiprocess import run_group


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding the final state of a fault-free run, in the disk tier's format."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = run_group(processes=NPROCS, steps=STEPS, run_dir=run_dir, faults=[])
    assert result.ok and result.step == STEPS and result.recoveries == []
    return run_dir / "final"
