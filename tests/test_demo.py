"""The demo as a user runs it: the real console entry point in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runtime import RecoveryCompleted, SliceLost, read_events


@pytest.mark.timeout(180)
def test_demo_loses_a_slice_recovers_scales_up_and_matches_the_reference(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_runtime.cli",
            "demo",
            "--steps",
            "150",
            "--json",
            "--verify",
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["ok"] and summary["steps_completed"] == 150
    assert summary["final_loss"] < 0.5  # it learns: the first loss is about 1.3
    [failure] = summary["failures"]
    assert failure["kind"] == "SliceLost" and failure["step"] == 50
    assert failure["lost_steps"] == 0 and failure["restored_from"] == "ram"
    assert 0 < failure["recovery_s"] < 30
    shapes = [entry["shape"] for entry in summary["mesh_history"]]
    assert shapes == [{"data": 4, "model": 2}, {"data": 3, "model": 2}, {"data": 4, "model": 2}]
    assert 0 < summary["goodput"] <= 1
    assert summary["reference_match"]["comparison"] == "rtol 1e-05" and summary["reference_match"]["match"]
    # Live progress came before the summary, and the log is a readable record of the same run.
    assert any("SliceLost at step 50" in line for line in lines)
    events = read_events(run_dir / "events.jsonl")
    assert [e.step for e in events if isinstance(e, SliceLost)] == [50]
    assert [round(e.recovery_s, 4) for e in events if isinstance(e, RecoveryCompleted)] == [failure["recovery_s"]]


def test_help_is_fast_and_lists_the_demo() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_runtime.cli", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "demo" in proc.stdout
