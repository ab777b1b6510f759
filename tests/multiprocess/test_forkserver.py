"""The fork server (``runtime/cluster/controller/forkserver.py``), driven alone: a real server process that imported
JAX forks real workers. Each runs its command as ``python`` would, with the environment of its request (not the
server's), its output in its own log; its exit code and its death by a signal come back through the server; and
when the server dies, its children die with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_runtime.cli.demo_multiprocess import group_controller
from elastic_runtime.cluster.controller.forkserver import ForkServer, forkable
from elastic_runtime.cluster.controller.processes import descends_from, dying_with_controller, parent_of, state_of
from elastic_runtime.core.events import WorkerStarted

SCRIPT = """\
import os, sys, time
print("argv", sys.argv[1:], "name", __name__, "var", os.environ.get("FORK_TEST_VAR"), "shared", "jax" in sys.modules)
sys.stdout.flush()
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[2]))
"""


def test_only_python_running_a_module_or_a_script_is_forked() -> None:
    assert forkable(["/usr/bin/python3", "-m", "elastic_runtime.cli.demo_multiprocess", "--worker"])
    assert forkable([".venv/bin/python", "train.py", "--steps", "3"])
    assert not forkable(["python", "-u", "train.py"])  # an interpreter option changes how it runs
    assert not forkable(["python", "-m"]) and not forkable(["python"])
    assert not forkable(["bash", "-c", "python train.py"]) and not forkable(["./train.py"])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    forks = ForkServer([sys.executable, "x.py"], dict(os.environ), tmp_path / "server.log", dying_with_controller)
    deadline = time.monotonic() + 120
    while not forks.ready:
        assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
        time.sleep(0.05)
    yield forks
    forks.close()


def test_a_forked_worker_runs_its_script_with_its_own_environment_and_its_exit_code_comes_back(
    server: ForkServer, tmp_path: Path
) -> None:
    script = tmp_path / "work.py"
    script.write_text(SCRIPT)
    env = {"FORK_TEST_VAR": "worker-7", "PATH": os.environ.get("PATH", "")}
    child = server.spawn([sys.executable, str(script), "exit", "3"], env, tmp_path / "worker.log")
    assert child is not None and descends_from(child.pid, child.pid)
    assert child.wait(timeout=60) == 3 and child.poll() == 3
    log = (tmp_path / "worker.log").read_text()
    # Its arguments, run as __main__, the request's variable, and JAX imported already (by the server).
    assert log.startswith("argv ['exit', '3'] name __main__ var worker-7 shared True"), log


def test_a_killed_worker_is_reported_as_killed_and_the_servers_death_takes_its_children(
    server: ForkServer, tmp_path: Path
) -> None:
    script = tmp_path / "work.py"
    script.write_text(SCRIPT)
    first = server.spawn([sys.executable, str(script), "sleep", "0"], {}, tmp_path / "first.log")
    second = server.spawn([sys.executable, str(script), "sleep", "0"], {}, tmp_path / "second.log")
    assert first is not None and second is not None and first.poll() is None
    born = _started(second.pid)  # its start time: a pid reused later (pid_max is 32768 here) is another process
    assert born is not None
    first.kill()
    assert first.wait(timeout=60) == -signal.SIGKILL
    server.close()
    assert second.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while _started(second.pid) == born and "Z" not in _state(second.pid):
        assert time.monotonic() < deadline, "the server's child outlived it"
        time.sleep(0.05)
    assert server.spawn([sys.executable, str(script), "exit", "0"], {}, tmp_path / "late.log") is None


# Run by a fresh interpreter: a fork of the test process, whose JAX threads are running, would deadlock in the child.
SERVER_DIES_FIRST = """\
import os, sys, time
from elastic_runtime.cluster.controller import forkserver

request = {"argv": [sys.argv[1]], "env": {}, "log": sys.argv[2]}
me = os.getpid()
if os.fork() == 0:  # the child: runs only once its server (this process) is gone
    while os.getppid() == me:
        time.sleep(0.01)
    try:
        said = forkserver._run_child(request, me)
    except SystemExit as exit:
        said = exit.code
    print(said, flush=True)
os._exit(0)
"""


def test_a_child_whose_server_died_before_it_ran_does_not_start(tmp_path: Path) -> None:
    """The server answers a child's pid as it forks it and may die before the child runs: the child must see that
    its server is gone, not take whoever adopted it for the parent it dies with (it outlived the server, 1 run in
    a full ``make test``)."""
    marker, log = tmp_path / "ran", tmp_path / "child.log"
    script = tmp_path / "work.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    # The server exits at once; its output pipe stays open until the child, which shares it, has printed and ended.
    said = subprocess.run(
        [sys.executable, "-c", SERVER_DIES_FIRST, str(script), str(log)], capture_output=True, text=True, timeout=60
    ).stdout
    assert "is gone; not starting" in said, said
    assert not marker.exists() and not log.exists()


def _started(pid: int) -> str | None:
    """``pid``'s start time (``/proc/PID/stat``, field 22); None when no process has the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _state(pid: int) -> str:
    return state_of(pid) or "Z"


@pytest.mark.timeout(300)
def test_a_launch_forks_its_first_workers_too(tmp_path: Path) -> None:
    # One JAX import on the machine for the whole group, not one a worker (docs/benchmarks.md, "Start-up"): the
    # controller waits for the server's imports before it starts the first workers, so their parent is the server.
    controller = group_controller(processes=2, steps=3, run_dir=tmp_path, faults=[], spares=0)
    parents: dict[int, int | None] = {}

    async def note_parent(event: WorkerStarted, ctx: object) -> None:
        parents[event.worker] = parent_of(event.pid)

    controller.bus.subscribe(WorkerStarted, note_parent)
    result = controller.run()
    assert result.ok, result.reason
    assert sorted(parents) == [0, 1]
    assert all(parent is not None and parent != os.getpid() for parent in parents.values()), parents


def test_workers_get_a_process_group_of_their_own_in_the_controller_s_session(
    server: ForkServer, tmp_path: Path
) -> None:
    # A group of its own keeps a terminal's Ctrl-C off it; a session of its own would also give it an autogroup
    # of its own, which made the steps 1.25x slower on 2 busy cores (docs/benchmarks.md).
    from elastic_runtime.cluster.config import LaunchConfig
    from elastic_runtime.cluster.controller.processes import ProcessPool

    script = tmp_path / "work.py"
    script.write_text(SCRIPT)
    forked = server.spawn([sys.executable, str(script), "sleep", "0"], dict(os.environ), tmp_path / "forked.log")
    config = LaunchConfig(command=[sys.executable, str(script), "sleep", "0"], nprocs=1, fork_spares=False)
    started = ProcessPool(config, tmp_path, str(tmp_path), "secret").spawn().popen
    assert forked is not None and started is not None
    try:
        for child in (forked, started):
            deadline = time.monotonic() + 60
            while os.getpgid(child.pid) != child.pid:  # a fork sets its group itself, just after it starts
                assert time.monotonic() < deadline, "no process group of its own"
                time.sleep(0.05)
            assert os.getsid(child.pid) == os.getsid(0)
    finally:
        for child in (forked, started):
            child.kill()
            child.wait(timeout=60)
