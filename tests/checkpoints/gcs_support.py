"""Helpers the storage tests share (plain functions and classes; the fixtures stay in conftest.py).

A module of its own, because ``from conftest import ...`` finds whichever conftest was imported last.
"""

from __future__ import annotations

import numpy as np

from elastic_runtime.storage.gcs import make_client
from elastic_runtime.testing.gcs_emulator import RunningEmulator

BUCKET = "ckpt"
Emulator = RunningEmulator  # the emulator process, and ``url``: a pass-through proxy in front of it


def client_for(url: str):  # type: ignore[no-untyped-def]
    return make_client(endpoint=url)


def small_state(seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "w": rng.standard_normal((64, 32)).astype(np.float32),
            "b": rng.standard_normal((32,)).astype(np.float32),
        },
        "opt": [rng.standard_normal((64, 32)).astype(np.float32), np.asarray(seed, np.int32)],
        "rng": np.asarray([seed, 7], np.uint32),
    }
