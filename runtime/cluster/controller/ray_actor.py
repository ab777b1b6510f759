"""What runs in each Ray actor of the Ray backend (``ray_backend.py``): the training command as a child process.

Only the standard library: the class is sent to the actors by value (``cloudpickle.register_pickle_by_value``), so
that an actor's process imports neither this package nor JAX before it starts its child.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["WorkerActor"]


class WorkerActor:
    """What runs in each Ray actor: the training command as a child process, started, awaited and stopped.

    Made a Ray actor class by ``ray_backend.RayPlacement`` (``max_concurrency`` 3: ``stop`` is served while
    ``wait`` blocks).
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._scratch = ""
        self._started = threading.Event()

    def start(
        self, command: Sequence[str], env: Mapping[str, str], log_path: str, cwd: str | None, scratch: str
    ) -> int:
        """Start the child with the actor's environment plus ``env``; its output goes to ``log_path`` on this
        node, and ``scratch`` (a folder; "" for none) is removed when it exits. Returns the child's pid."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self._scratch = scratch
        with open(log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                list(command),
                env=dict(os.environ) | dict(env),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=cwd if cwd and os.path.isdir(cwd) else None,
                start_new_session=True,  # outlives the actor: see the module's docstring
            )
        self._started.set()
        return self._proc.pid

    def wait(self) -> int:
        """Block until the child exits; its exit code. Its scratch folder goes with it."""
        self._started.wait()
        assert self._proc is not None
        code = self._proc.wait()
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
        return code

    def stop(self) -> None:
        """SIGKILL the child, if it still runs (a hung worker must not come back into a re-formed group)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
