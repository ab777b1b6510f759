"""Start and stop the real Pub/Sub emulator (Google's, from the Cloud SDK) on a free loopback port.

Used by the tests and by ``tests/benchmarks/bench_notice_latency.py``. The emulator ships in the Debian
package ``google-cloud-cli-pubsub-emulator`` (Java 17), part of this project's machine image. Its launcher is
run directly when found next to ``gcloud`` (one process, about a second faster than going through
``gcloud beta emulators pubsub start``, which is the fallback). Each emulator runs in its own process group,
so stopping it stops the JVM too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["EmulatorMissing", "PubSubEmulator", "emulator_command", "free_port"]


class EmulatorMissing(RuntimeError):
    """Neither the emulator's launcher nor gcloud (with the emulator component) is installed."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def emulator_command(port: int) -> list[str]:
    """The command that starts the emulator on 127.0.0.1:``port``. Raises EmulatorMissing."""
    gcloud = shutil.which("gcloud")
    roots = [Path(gcloud).resolve().parent.parent] if gcloud else []
    roots.append(Path("/usr/lib/google-cloud-sdk"))
    for root in roots:
        launcher = root / "platform" / "pubsub-emulator" / "bin" / "cloud-pubsub-emulator"
        if launcher.is_file() and shutil.which("java"):
            return [str(launcher), "--host=127.0.0.1", f"--port={port}"]
    if gcloud:
        return [gcloud, "beta", "emulators", "pubsub", "start", f"--host-port=127.0.0.1:{port}", "--quiet"]
    raise EmulatorMissing(
        "the Pub/Sub emulator is not installed (Debian package google-cloud-cli-pubsub-emulator from Google "
        "Cloud's apt repository, and Java 17: openjdk-17-jre-headless)"
    )


class PubSubEmulator:
    """One emulator process. ``start()`` returns once it answers; ``restart()`` keeps the port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="pubsub-emulator-", suffix=".log")[1])

    @property
    def host(self) -> str:
        """What ``PUBSUB_EMULATOR_HOST`` must be set to."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        command = emulator_command(self.port)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the emulator exited with {self.process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.host}/", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the emulator did not answer on {self.host} within {timeout} s: {self.log_tail()}")

    def stop(self, *, crash: bool = False) -> None:
        """Stop the emulator: SIGTERM (SIGKILL after 5 s), or at once with SIGKILL when ``crash``."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL if crash else signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def restart(self) -> None:
        """Crash (SIGKILL) and start again on the same port. The emulator keeps nothing: topics are gone."""
        self.stop(crash=True)
        self.start()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
