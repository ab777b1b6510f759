"""``elastic-runtime launch`` as a process of its own, as a user or systemd starts it: for the tests and the
chaos loop that kill or signal the controller itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from elastic_runtime.core.errors import EventLogError
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import Event, StepCompleted, WorkerStarted

__all__ = [
    "GLOO_ABORT",
    "aborted_by_gloo",
    "alive",
    "events_so_far",
    "launch",
    "wait_for_step",
    "wait_until_gone",
    "worker_pids",
]

# What a worker's log ends with when gloo aborted it after a peer's kill (``std::terminate`` in gloo's transport
# thread, which no code in the process can catch; docs/multiprocess.md, "JAX limits met").
GLOO_ABORT = "Received data size doesn't match expected size"


def launch(
    run_dir: Path, worker: list[str], *extra: str, nprocs: int, step_delay_s: float = 0.0
) -> subprocess.Popen[bytes]:
    """Start ``python -m elastic_runtime.cli launch --nprocs N --run-dir RUN_DIR --result RUN_DIR/final EXTRA --
    WORKER``."""
    env = dict(os.environ, ELASTIC_STEP_DELAY_S=str(step_delay_s))
    command = [
        sys.executable,
        "-m",
        "elastic_runtime.cli",
        "launch",
        "--nprocs",
        str(nprocs),
        "--run-dir",
        str(run_dir),
    ]
    command += ["--result", str(run_dir / "final"), *extra, "--", *worker]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def events_so_far(run_dir: Path) -> list[Event]:
    """The run's events so far (none while a line is half written)."""
    try:
        return read_events(run_dir / "events.jsonl")
    except (EventLogError, FileNotFoundError):
        return []


def wait_for_step(run_dir: Path, controller: subprocess.Popen[bytes], step: int) -> None:
    """Until the group committed ``step``. Raises RuntimeError (with the controller's output) if it exited."""
    while not any(isinstance(e, StepCompleted) and (e.step or 0) >= step for e in events_so_far(run_dir)):
        if controller.poll() is not None:
            output = (controller.communicate()[0] or b"").decode()  # and closes its pipe
            raise RuntimeError(f"the controller exited with {controller.returncode} before step {step}: {output}")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def worker_pids(run_dir: Path) -> list[int]:
    """Every worker process the run's controllers started."""
    return [e.pid for e in events_so_far(run_dir) if isinstance(e, WorkerStarted)]


def wait_until_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """Wait for ``pids`` to end; returns those still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def aborted_by_gloo(run_dir: Path, workers: Iterable[int]) -> list[int]:
    """Those of ``workers`` whose log in ``run_dir`` ends with gloo's abort (:data:`GLOO_ABORT`)."""
    return [w for w in workers if GLOO_ABORT in (run_dir / "workers" / f"worker-{w}.log").read_text()]
