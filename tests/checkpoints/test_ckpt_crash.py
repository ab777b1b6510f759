"""kill -9 of a real process in the middle of a disk write and of an upload: the previous committed step is
what a restore finds, and the torn step is invisible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gcs_support import BUCKET, Emulator, client_for

from elastic_runtime.storage import manifest as mf
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.gcs import GcsTier
from elastic_runtime.testing.faultproxy import FaultProxy

WORKER = Path(__file__).with_name("crash_worker.py")


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def wait_line(process: subprocess.Popen[str], expected: str, timeout: float = 60) -> None:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.strip() == expected:
            return
        if not line and process.poll() is not None:
            raise AssertionError(f"worker exited ({process.returncode}) before {expected!r}: {process.stderr.read()}")
    raise AssertionError(f"no {expected!r} within {timeout} s")


def kill9(process: subprocess.Popen[str]) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def test_kill_during_disk_write(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    torn = root / mf.step_dirname(2)
    process = start("disk", str(root))
    try:
        wait_line(process, "COMMITTED 1")
        # Kill once the step-2 write has put data on disk but before its manifest exists.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            written = sum(f.stat().st_size for f in torn.rglob("*") if f.is_file()) if torn.exists() else 0
            if written > 16 << 20:
                break
            time.sleep(0.002)
        kill9(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert torn.exists() and not (torn / mf.MANIFEST_NAME).exists(), "the write was not caught in the middle"
    disk = DiskTier(root)
    assert [i.step for i in disk.list(timeout=10)] == [1]
    restored = disk.latest(None)
    assert restored.step == 1
    np.testing.assert_array_equal(restored.tree["a03"], np.full(1024, 103, np.float32))
    assert disk.sweep() == [torn]  # the next writer clears the torn directory


@pytest.mark.parametrize("cut", ["mid-data", "before-manifest"])
def test_kill_during_upload(tmp_path: Path, gcs_emulator: Emulator, gcs_uri: str, cut: str) -> None:
    root = tmp_path / "ckpt"
    prefix = gcs_uri.removeprefix(f"gs://{BUCKET}/")
    with FaultProxy(("127.0.0.1", gcs_emulator.port)) as proxy:
        # Hold one request of the step-2 upload until the process is dead.
        target = f"{prefix}/{mf.step_dirname(2)}/"
        proxy.hold_pattern = target + ("state/a03" if cut == "mid-data" else mf.MANIFEST_NAME)
        process = start("gcs", str(root), gcs_uri, env={"STORAGE_EMULATOR_HOST": proxy.url})
        try:
            wait_line(process, "COMMITTED 1")
            assert proxy.held.wait(60), "the upload never reached the held request"
            time.sleep(0.2)  # let the other workers' requests land
            kill9(process)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            proxy.release.set()
    gcs = GcsTier(gcs_uri, client=client_for(gcs_emulator.url), staging_dir=tmp_path)
    uploaded = [b.name for b in gcs.client.list_blobs(BUCKET, prefix=target)]
    assert uploaded, "nothing of step 2 reached GCS: the kill was not mid-upload"
    assert f"{target}{mf.MANIFEST_NAME}" not in uploaded
    assert [i.step for i in gcs.list(timeout=30)] == [1]
    restored = gcs.latest(None)
    assert restored.step == 1
    np.testing.assert_array_equal(restored.tree["a00"], np.full(1024, 100, np.float32))
    # After the restart the committed disk checkpoint of step 2 uploads again and commits.
    gcs.upload(DiskTier(root).path_of(2), timeout=60)
    assert [i.step for i in gcs.list(timeout=30)] == [2, 1]
