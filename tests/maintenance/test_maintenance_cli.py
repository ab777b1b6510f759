"""``elastic-runtime listen`` as an operator runs it: the console script, against the emulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import notices
import pytest
from metadata_server import FakeMetadataServer
from pubsub_support import Topic

CLI = str(Path(sys.executable).with_name("elastic-runtime"))


def listen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, "listen", *args], capture_output=True, text=True, timeout=90, env=os.environ.copy(), check=False
    )


def test_listen_prints_notices_as_json(topic: Topic) -> None:
    # Published before the listener starts: the subscription keeps them until they are acked.
    topic.publish(notices.upcoming(name="worker-3", start=1_900_000_000.0, end=1_900_003_600.0))
    topic.publish(b"garbage")
    done = listen("--subscription", topic.subscription, "--json", "--count", "2", "--timeout", "60")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(line["type"] for line in lines) == ["MaintenanceScheduled", "MalformedNotice"]
    scheduled = next(line for line in lines if line["type"] == "MaintenanceScheduled")
    assert scheduled["instance"] == "worker-3" and scheduled["window_start"] == 1_900_000_000.0


def test_listen_prints_one_line_per_notice(topic: Topic) -> None:
    topic.publish(notices.log_entry("preempted", name="worker-5"))
    topic.publish(notices.log_entry("preempted", name="worker-6"))
    done = listen("--subscription", topic.subscription, "--instance", "worker-6", "--count", "1", "--timeout", "60")
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    assert "Preempted instance=worker-6 kind=PREEMPTED" in line


def test_listen_refuses_a_bad_subscription(capsys: pytest.CaptureFixture[str]) -> None:
    from elastic_runtime.cli.main import main

    assert main(["listen", "--subscription", "my-subscription"]) == 2
    assert "projects/P/subscriptions/S" in capsys.readouterr().err
    assert main(["listen"]) == 2


def test_listen_watches_a_metadata_server() -> None:
    with FakeMetadataServer() as server:
        server.set("instance/preempted", b"TRUE")
        done = listen("--metadata-host", server.host, "--count", "1", "--timeout", "60")
    assert done.returncode == 0, done.stderr
    assert "Preempted instance=meta-vm kind=PREEMPTED" in done.stdout
