"""``elastic-runtime checkpoints list|verify`` on a local directory and on a GCS prefix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests_storage_helpers import snapshot

from elastic_runtime.cli.main import main
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.gcs import GcsTier


def test_list_and_verify_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    disk = DiskTier(tmp_path)
    for step in (2, 4):
        disk.save(snapshot(step), timeout=30)
    assert main(["checkpoints", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step_0000000004" in out and "step_0000000002" in out
    assert out.index("step_0000000004") < out.index("step_0000000002")
    assert main(["checkpoints", "verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("ok ") == 2
    bad = disk.path_of(2) / max(disk.manifest(2).files, key=lambda f: f.size).path
    data = bytearray(bad.read_bytes())
    data[100] ^= 1
    bad.write_bytes(bytes(data))
    assert main(["checkpoints", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"BAD  step 2: {bad}" in out and "ok   step 4" in out


def test_verify_gcs_names_the_bad_object(tmp_path: Path, gcs_uri: str, capsys: pytest.CaptureFixture[str]) -> None:
    gcs = GcsTier(gcs_uri, staging_dir=tmp_path)
    gcs.save(snapshot(3), timeout=60)
    assert main(["checkpoints", "list", gcs_uri]) == 0
    assert f"{gcs_uri}/step_0000000003" in capsys.readouterr().out
    assert main(["checkpoints", "verify", "--deep", gcs_uri]) == 0
    capsys.readouterr()
    name = max(gcs.manifest(3).files, key=lambda f: f.size).path
    blob = gcs.client.bucket(gcs.bucket_name).blob(gcs._key(3, name))
    blob.upload_from_string(blob.download_as_bytes()[:-1])
    assert main(["checkpoints", "verify", gcs_uri]) == 1
    assert f"BAD  step 3: {gcs_uri}/step_0000000003/{name}" in capsys.readouterr().out


def test_console_script_exit_status(tmp_path: Path) -> None:
    DiskTier(tmp_path).save(snapshot(1), timeout=30)
    (DiskTier(tmp_path).path_of(1) / "state" / "_METADATA").write_text("{}")
    done = subprocess.run(
        [sys.executable, "-m", "elastic_runtime.cli", "checkpoints", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done.stderr
    assert "_METADATA" in done.stdout


@pytest.mark.parametrize("action", ["list", "verify"])
def test_a_missing_directory_exits_2_and_is_not_created(
    tmp_path: Path, action: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-run" / "checkpoints"
    assert main(["checkpoints", action, str(missing)]) == 2
    assert f"{missing}: no such directory" in capsys.readouterr().err
    assert not missing.exists()


@pytest.mark.parametrize("action", ["list", "verify"])
def test_a_missing_bucket_exits_2_with_a_message(gcs_uri: str, action: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", action, "--timeout", "20", "gs://no-such-bucket-here/x"]) == 2
    err = capsys.readouterr().err
    assert "no-such-bucket-here" in err and "Traceback" not in err
