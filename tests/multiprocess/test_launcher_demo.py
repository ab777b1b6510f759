"""``elastic-runtime demo --processes N --kill-worker-at STEP --json --verify``, end to end through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_runtime.cli.main import main


@pytest.mark.timeout(150)
def test_demo_kills_a_worker_and_matches_the_fault_free_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "demo",
            "--processes",
            "3",
            "--kill-worker-at",
            "10",
            "--steps",
            "30",
            "--run-dir",
            str(tmp_path),
            "--json",
            "--verify",
        ]
    )
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0, out
    assert "WorkerLost" in out and "RecoveryCompleted" in out  # live progress was printed
    assert summary["ok"] and summary["steps_completed"] == 30
    assert summary["strategy"] == "reform" and summary["restored_from"].startswith("ram")
    assert summary["lost_steps"] == 0
    assert summary["survivor_restarts"] == 0
    assert summary["world_size_history"] == [3, 3]
    assert 0 <= summary["detected_after_s"] < 2.5 and summary["recovery_s"] > 0
    assert summary["reference_match"] | {"worst_leaf": ""} == {
        "comparison": "bitwise",
        "match": True,
        "max_rel_error": 0.0,
        "worst_leaf": "",
    }


@pytest.mark.parametrize("given", ["1", "x:5", "1:-2"])
def test_a_malformed_corruption_is_refused_before_anything_starts(
    given: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["demo", "--processes", "2", "--slices", "2", "--corrupt-worker-at", given, "--run-dir", str(tmp_path)])
    assert code == 2 and "expected P:STEP" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # no controller, no worker
