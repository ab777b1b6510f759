"""Snapshots for the storage tests."""

from __future__ import annotations

from gcs_support import small_state

from elastic_runtime.core.snapshot import HostSnapshot


def snapshot(step: int) -> HostSnapshot:
    return HostSnapshot(
        step=step,
        data_position=10 * step,
        tree=small_state(step),
        nbytes=0,
        seconds=0.0,
        metadata={"mesh": {"data": 8}, "rng": [step, 7], "note": "ok"},
    )
