"""Fixtures for the storage tests: the real GCS emulator on a free port, a fault proxy in front of it, and
small states to checkpoint."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
from faultproxy import FaultProxy
from gcs_support import BUCKET, EMULATOR, Emulator, free_port


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """gcp-storage-emulator in its own process, in memory, with bucket ``ckpt``."""
    if not EMULATOR.exists():
        pytest.skip(f"{EMULATOR} is not installed (pip install gcp-storage-emulator)")
    port = free_port()
    log = open(tmp_path_factory.mktemp("emulator") / "emulator.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [
            str(EMULATOR),
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
            "--default-bucket",
            BUCKET,
            "--quiet",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                log.close()
                pytest.fail("the GCS emulator did not start")
            time.sleep(0.1)
    proxy = FaultProxy(("127.0.0.1", port)).start()
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
    try:
        yield Emulator(port, process, proxy)
    finally:
        proxy.close()
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture
def gcs_uri(gcs_emulator: Emulator) -> str:
    """A fresh prefix in the emulator's bucket for one test."""
    return f"gs://{BUCKET}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def fault_proxy(gcs_emulator: Emulator) -> Iterator[FaultProxy]:
    with FaultProxy(("127.0.0.1", gcs_emulator.port)) as proxy:
        yield proxy
