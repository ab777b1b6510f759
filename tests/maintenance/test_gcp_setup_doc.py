"""docs/gcp-setup.md's example notice is one the parser reads, and its ``gcloud pubsub topics publish`` block works
as written against the emulator (set up as the page's "Local development" says)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pubsub_support import PROJECT, make_topic

from elastic_runtime.core.events import MaintenanceScheduled
from elastic_runtime.maintenance.formats import parse_message

DOC = Path(__file__).resolve().parents[2] / "docs" / "gcp-setup.md"
WINDOW = (1_893_492_000.0, 1_893_495_600.0)  # 2030-01-01T10:00:00Z to 11:00


def example_block() -> str:
    """The bash block after the page's ``<!-- example-notice -->`` marker."""
    after = DOC.read_text().split("<!-- example-notice -->", 1)[1]
    return after.split("```bash\n", 1)[1].split("\n```", 1)[0]


def test_the_example_notice_is_a_scheduled_window() -> None:
    data = example_block().split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    [notice] = parse_message(data.encode(), {})
    event = notice.event
    assert isinstance(event, MaintenanceScheduled) and event.instance == "t1v-n-1a2b3c4d-w-0"
    assert (event.window_start, event.window_end) == WINDOW and event.can_reschedule
    assert notice.identities == ("t1v-n-1a2b3c4d-w-0", "4711") and notice.project == "my-project"


def test_the_example_publishes_with_gcloud_to_the_emulator(pubsub_clients: tuple[Any, Any], tmp_path: Path) -> None:
    if shutil.which("gcloud") is None:
        pytest.skip("gcloud is not installed")
    publisher, subscriber = pubsub_clients
    topic = make_topic(publisher, subscriber)
    emulator = os.environ["PUBSUB_EMULATOR_HOST"]
    env = os.environ | {
        "CLOUDSDK_API_ENDPOINT_OVERRIDES_PUBSUB": f"http://{emulator}/",
        "CLOUDSDK_AUTH_DISABLE_CREDENTIALS": "true",
        "CLOUDSDK_CONFIG": str(tmp_path),  # no configuration of this machine's
        "PROJECT_ID": PROJECT,
        "TOPIC": topic.topic.rsplit("/", 1)[1],
    }
    done = subprocess.run(["bash", "-c", example_block()], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pulled = subscriber.pull(subscription=topic.subscription, max_messages=1, timeout=30)
    [received] = pulled.received_messages
    [notice] = parse_message(received.message.data, dict(received.message.attributes))
    assert (
        isinstance(notice.event, MaintenanceScheduled)
        and (notice.event.window_start, notice.event.window_end) == WINDOW
    )
