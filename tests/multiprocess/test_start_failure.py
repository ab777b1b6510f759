"""A worker command that fails before it reaches the runtime ends the launch at once, its traceback on the console
(before: thousands of workers started in two minutes, the error only in their log files)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runtime import read_events
from elastic_runtime.cluster.controller.workers import START_FAILURES
from elastic_runtime.core.events import WorkerStarted


@pytest.mark.parametrize("spares", [0, 1])
def test_a_script_that_raises_at_import_ends_the_launch_with_its_error(tmp_path: Path, spares: int) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise ZeroDivisionError('the user script is broken at line 1')\n")
    command = [sys.executable, "-m", "elastic_runtime.cli", "launch", "--nprocs", "2", "--spares", str(spares)]
    command += ["--run-dir", str(tmp_path / "run"), "--", sys.executable, str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    # On the launch's own console: the exception, the count, and where the whole log is.
    assert "ZeroDivisionError: the user script is broken at line 1" in done.stderr
    assert f"{START_FAILURES} workers in a row exited before connecting" in done.stderr
    assert str(tmp_path / "run" / "workers") in done.stderr
    started = [e for e in read_events(tmp_path / "run" / "events.jsonl") if isinstance(e, WorkerStarted)]
    # The first ones, and a few replacements: those started while the third exit was on its way are counted too
    # (before the change: 3,355 in two minutes).
    assert len(started) <= 2 * (2 + spares) + START_FAILURES
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ok"] is False and "before connecting" in summary["reason"]
