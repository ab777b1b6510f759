"""A process for the crash tests to kill -9: it commits step 1, then writes or uploads step 2 until killed.

Usage: python crash_worker.py disk ROOT | python crash_worker.py gcs ROOT GS_URI
(the GCS client reaches the emulator through STORAGE_EMULATOR_HOST).
"""

from __future__ import annotations

import sys

import numpy as np

from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.disk import DiskTier


def state(step: int, arrays: int, size: int) -> dict[str, np.ndarray]:
    return {f"a{i:02d}": np.full(size, step * 100 + i, np.float32) for i in range(arrays)}


def snap(step: int, arrays: int, size: int) -> HostSnapshot:
    return HostSnapshot(
        step=step, data_position=step, tree=state(step, arrays, size), nbytes=0, seconds=0.0, metadata={}
    )


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    disk = DiskTier(root)
    if mode == "disk":
        disk.save(snap(1, 4, 1024), timeout=60)
        print("COMMITTED 1", flush=True)
        disk.save(snap(2, 48, 1 << 20), timeout=120)  # 192 MB in 48 files: long enough to be caught mid-write
        print("COMMITTED 2", flush=True)
    elif mode == "gcs":
        from elastic_runtime.storage.gcs import GcsTier

        gcs = GcsTier(sys.argv[3], workers=4, request_timeout_s=120)
        first = disk.save(snap(1, 4, 1024), timeout=60)
        second = disk.save(snap(2, 8, 1024), timeout=60)
        gcs.upload(first.location, timeout=60)
        print("COMMITTED 1", flush=True)
        gcs.upload(second.location, timeout=600)
        print("COMMITTED 2", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
