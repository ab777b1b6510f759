"""The GCS emulator (``gcp-storage-emulator`` from PyPI) on a free loopback port, for tests and the demo.

The emulator serves one connection at a time, so a client's idle keep-alive connection stalls every other
client for about a second; a threaded pass-through :class:`~elastic_runtime.testing.faultproxy.FaultProxy` in front
of it opens one upstream connection per request, which keeps parallel transfers (and several processes)
parallel. Clients reach it through ``STORAGE_EMULATOR_HOST`` (``elastic_runtime.storage.gcs.make_client``).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from elastic_runtime.testing.faultproxy import FaultProxy

__all__ = ["EMULATOR", "RunningEmulator", "free_port", "running_emulator"]

EMULATOR = Path(sys.executable).with_name("gcp-storage-emulator")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RunningEmulator:
    port: int  # the emulator's own port
    process: subprocess.Popen[bytes]
    proxy: FaultProxy  # in front of it; ``url`` is what clients use

    @property
    def url(self) -> str:
        return self.proxy.url


@contextlib.contextmanager
def running_emulator(bucket: str, log: Path, *, start_timeout_s: float = 30.0) -> Iterator[RunningEmulator]:
    """The emulator, in memory, with ``bucket``, its output in ``log``; stopped on exit.

    Raises:
        FileNotFoundError: ``gcp-storage-emulator`` is not installed next to this Python.
        RuntimeError: it did not start within ``start_timeout_s``.
    """
    if not EMULATOR.exists():
        raise FileNotFoundError(f"{EMULATOR} is not installed (pip install gcp-storage-emulator)")
    port = free_port()
    command = [str(EMULATOR), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    with open(log, "wb") as out:
        process = subprocess.Popen([*command, "--default-bucket", bucket, "--quiet"], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the GCS emulator did not start; see {log}") from None
                time.sleep(0.1)
        proxy = FaultProxy(("127.0.0.1", port)).start()
        try:
            yield RunningEmulator(port, process, proxy)
        finally:
            proxy.close()
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
