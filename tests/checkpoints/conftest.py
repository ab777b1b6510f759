"""Fixtures for the storage tests: the real GCS emulator on a free port, a fault proxy in front of it, and
small states to checkpoint."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from gcs_support import BUCKET, Emulator

from elastic_runtime.testing.faultproxy import FaultProxy
from elastic_runtime.testing.gcs_emulator import EMULATOR, running_emulator


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """gcp-storage-emulator in its own process, in memory, with bucket ``ckpt``."""
    if not EMULATOR.exists():
        pytest.skip(f"{EMULATOR} is not installed (pip install gcp-storage-emulator)")
    try:
        with running_emulator(BUCKET, tmp_path_factory.mktemp("emulator") / "emulator.log") as emulator:
            previous = os.environ.get("STORAGE_EMULATOR_HOST")
            os.environ["STORAGE_EMULATOR_HOST"] = emulator.url
            try:
                yield emulator
            finally:
                if previous is None:
                    os.environ.pop("STORAGE_EMULATOR_HOST", None)
                else:
                    os.environ["STORAGE_EMULATOR_HOST"] = previous
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def gcs_uri(gcs_emulator: Emulator) -> str:
    """A fresh prefix in the emulator's bucket for one test."""
    return f"gs://{BUCKET}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def fault_proxy(gcs_emulator: Emulator) -> Iterator[FaultProxy]:
    with FaultProxy(("127.0.0.1", gcs_emulator.port)) as proxy:
        yield proxy
