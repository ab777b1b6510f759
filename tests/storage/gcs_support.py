"""Helpers the storage tests share (plain functions and classes; the fixtures stay in conftest.py).

A module of its own, because ``from conftest import ...`` finds whichever conftest was imported last.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from faultproxy import FaultProxy

from storage.gcs import make_client

EMULATOR = Path(sys.executable).with_name("gcp-storage-emulator")
BUCKET = "ckpt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Emulator:
    """The emulator process, and ``url``: a pass-through proxy in front of it.

    The emulator serves one connection at a time, so a client's idle keep-alive connection stalls the
    others for about a second; the threaded proxy opens one upstream connection per request, which keeps
    parallel transfers parallel. ``STORAGE_EMULATOR_HOST`` points at the proxy.
    """

    def __init__(self, port: int, process: subprocess.Popen[bytes], proxy: FaultProxy) -> None:
        self.port = port
        self.process = process
        self.proxy = proxy
        self.url = proxy.url


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
