"""The fault-free run every multi-process test compares with, made once per session (a launch costs ~10 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_support import fault_free_final


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder holding the final state of a fault-free run, in the disk tier's format."""
    return fault_free_final(tmp_path_factory.mktemp("reference"))
