"""One user script, its own handler file unchanged, run embedded (a slice lost and repaired) and under
``launch --nprocs 3 --min-nprocs 2`` (a worker killed, its replacement slow to start): the same observable results.

The script (``tests/userscript/train.py``) is a plain JAX + optax classifier written from the docs; its handlers
(``tests/userscript/handlers.py``) record what they saw. In both modes: the ``MeshChanged`` handler runs on the
shrink and on the growth (in every process), the once-per-event handler pages once per failure, ``run()`` returns
and the code after it runs, the step's ``accuracy`` is in the event log, and progress lines reach the console.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_runtime import StepCompleted, read_events

SCRIPT = Path(__file__).parents[1] / "userscript" / "train.py"
STEPS = 60


def records(out: Path, what: str) -> list[dict[str, Any]]:
    path = out / f"{what}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def progress_lines(console: str) -> list[str]:
    return [line for line in console.splitlines() if line.startswith("elastic-runtime: ")]


def accuracies(run_dir: Path) -> list[float]:
    events = read_events(run_dir / "events.jsonl")
    return [e.metrics["accuracy"] for e in events if isinstance(e, StepCompleted) and "accuracy" in e.metrics]


def test_embedded_with_a_lost_and_repaired_slice(tmp_path: Path) -> None:
    command = [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--lose-slice-at", "12", "--repair-at", "24"]
    command += ["--run-dir", str(tmp_path / "run")]
    env = {"USER_HANDLERS_OUT": str(tmp_path), "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_env(env), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(r["old"], r["new"]) for r in records(tmp_path, "mesh")] == [(4, 3), (3, 4)]  # shrink, then growth
    assert [r["failure"] for r in records(tmp_path, "page")] == ["SliceLost"]  # once per failure
    [after] = records(tmp_path, "after_run")  # run() returned; the code after it ran
    assert after == after | {"mode": "embedded", "lead": True, "step": STEPS, "has_state": True}
    assert [r["ok"] for r in records(tmp_path, "finished")] == [True]
    assert len(accuracies(tmp_path / "run")) == STEPS  # every step's, in the event log
    assert len(progress_lines(done.stderr)) >= 3
    assert json.loads(done.stdout.strip().splitlines()[-1])["lr"] == pytest.approx(0.05)  # 0.05 * 3/4 * 4/3


def test_under_launch_with_a_killed_worker_whose_replacement_is_slow(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "elastic_runtime.cli", "launch", "--nprocs", "3", "--min-nprocs", "2"]
    command += ["--spares", "0", "--spawn-timeout", "0.5", "--fault", "kill:1@8", "--run-dir", str(tmp_path / "run")]
    command += ["--", sys.executable, str(SCRIPT), "--steps", str(STEPS), "--run-dir", str(tmp_path / "run")]
    command += ["--slow-replacement-s", "2", "--batch-delay-s", "0.2"]  # the replacement joins before the end
    env = _env({"USER_HANDLERS_OUT": str(tmp_path)})
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size_history"] == [3, 2, 3]
    meshes = [(r["old"], r["new"], r["process"]) for r in records(tmp_path, "mesh")]
    assert sorted(meshes) == [(2, 3, 0), (2, 3, 1), (2, 3, 2), (3, 2, 0), (3, 2, 1)]  # in every process, each time
    assert [r["failure"] for r in records(tmp_path, "page")] == ["WorkerLost"]  # once, not once per process
    after = records(tmp_path, "after_run")
    assert len(after) == 3 and all(r["mode"] == "worker" and r["step"] == STEPS for r in after)
    assert [r["has_state"] for r in after if r["lead"]] == [True] and sum(r["has_state"] for r in after) == 1
    assert [r["ok"] for r in records(tmp_path, "finished")] == [True, True, True]
    assert accuracies(tmp_path / "run")  # the steps the workers' heartbeats reported
    lines = progress_lines(done.stderr)
    assert len(lines) >= 3
    # What the script set for one process and the launch decides is said, not ignored (its progress cadence).
    said = "the script's progress_every_s=1.0 does not apply under launch: the controller prints a line about"
    assert [line for line in lines if said in line], lines
    # The fault names a process of the group, the events worker ids: the console's line about it says both, and
    # the re-forming says why.
    [fault] = [line for line in lines if "fault injection: kill:1@8 (process 1 of the group: worker " in line]
    worker = fault.rsplit("worker ", 1)[1].rstrip(")")
    reforming = f"re-forming the group (reform): 2 workers, generation 2: worker {worker}: WorkerLost"
    assert [line for line in lines if reforming in line], lines


def _env(extra: dict[str, str]) -> dict[str, str]:
    return dict(os.environ) | extra
