"""``elastic-runtime demo --hosts N --lose-host-at STEP --json --verify``, end to end through the CLI.

The demo makes its own simulated hosts (``elastic_runtime.testing.hosts``: network namespaces, so root), loses
host 1, starts a replacement on an extra host once the survivors re-formed, and compares the final state
with a fault-free run. With ``--full-restart`` it stops the controller and every worker at the loss and
starts them all again with ``--resume`` from the replicas on disk (the baseline of
``tests/benchmarks/bench_hosts.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runtime.cli.launch import DEFAULTS
from elastic_runtime.cli.main import main

# Found by the heartbeat: the default timeout of a training worker, less a beat (the clock starts at the last
# heartbeat heard, a little before the host is lost).
BY_HEARTBEAT_S = DEFAULTS["heartbeat_timeout_s"] - 0.25


@pytest.mark.timeout(180)
@pytest.mark.heavy
def test_the_hosts_demo_loses_a_host_and_matches_the_fault_free_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    command = [sys.executable, "-m", "elastic_runtime.cli", "demo", "--hosts", "3", "--lose-host-at", "5", "--json"]
    command += ["--verify", "--run-dir", str(tmp_path / "demo")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    assert summary["ok"] and summary["step"] == summary["steps_completed"] == 60
    assert summary["lost_steps"] == 0 and summary["survivor_restarts"] == 0
    assert summary["reference_match"]["match"], summary["reference_match"]
    assert summary["world_size_history"] == [3, 2, 3]
    # Host 1 leaves; the replacement (worker 3) joins from host 3, the extra empty host.
    assert summary["hosts_history"] == [["host0", "host1", "host2"], ["host0", "host2"], ["host0", "host2", "host3"]]
    assert summary["refused_connections"] == 0
    assert summary["detected_after_s"] >= BY_HEARTBEAT_S  # not a closed connection
    assert summary["recovered_after_s"] > summary["detected_after_s"]
    print(f"\nhosts demo: {json.dumps(summary)}")


@pytest.mark.timeout(180)
@pytest.mark.heavy
def test_the_hosts_demo_restarts_everything_from_disk_with_full_restart(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    command = [
        sys.executable,
        "-m",
        "elastic_runtime.cli",
        "demo",
        "--hosts",
        "3",
        "--lose-host-at",
        "5",
        "--full-restart",
    ]
    command += ["--json", "--verify", "--run-dir", str(tmp_path / "demo")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    assert summary["ok"] and summary["step"] == 60 and summary["strategy"] == "full restart"
    # The first controller stopped at the loss (--max-failures 0); the second resumed the same run from the
    # newest replica on disk: nothing committed was lost, and every group had all 3 hosts.
    assert summary["controller_restarts"] == 1 and summary["survivor_restarts"] == 2
    assert summary["lost_steps"] == 0 and summary["resumed_from"] >= 5
    assert summary["hosts_history"] == [["host0", "host1", "host2"], ["host0", "host2", "host3"]]
    assert summary["reference_match"]["comparison"] == "bitwise" and summary["reference_match"]["match"]
    assert summary["recovered_after_s"] > summary["detected_after_s"] >= BY_HEARTBEAT_S
    assert any((tmp_path / "demo" / "disk" / "host0" / "worker-0").iterdir())  # the replicas were on disk
    print(f"\nhosts demo, full restart: {json.dumps(summary)}")


def test_the_hosts_demo_says_clearly_that_it_needs_root(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["demo", "--hosts", "3", "--lose-host-at", "5", "--json"]) == 2
    assert "--hosts needs root: each simulated host is a network namespace" in capsys.readouterr().err
    assert main(["demo", "--hosts", "3", "--lose-host-at", "5", "--partition-host-at", "7"]) == 2
    assert "exclusive" in capsys.readouterr().err
    assert main(["demo", "--hosts", "3", "--partition-host-at", "5", "--full-restart"]) == 2
    assert "--full-restart needs --lose-host-at" in capsys.readouterr().err


def test_the_controller_resumes_only_an_unfinished_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ELASTIC_RUNTIME_TOKEN", "s3cret")
    command = ["controller", "--listen", "127.0.0.1:0", "--nprocs", "2", "--resume"]
    with pytest.raises(SystemExit, match="--resume needs --run-dir"):
        main(command)
    assert main([*command, "--run-dir", str(tmp_path)]) == 1
    assert f"--resume: nothing to resume in {tmp_path}" in capsys.readouterr().err
