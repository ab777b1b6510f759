"""The run folder names the run: an unfinished run is continued, a finished one is followed by a new run,
and the default replica folder follows the run folder, not the process. Nothing is left behind: a finished run
(launch, service mode) leaves no replica folder in ``/dev/shm``, and a worker at start removes the folders of
runs that finished or whose processes are gone (``runtime/cluster/leftovers.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from test_auth import against

from elastic_runtime.cli.demo_multiprocess import run_group, worker_command
from elastic_runtime.cluster import auth, leftovers
from elastic_runtime.cluster.config import LaunchConfig
from elastic_runtime.cluster.controller.runfolder import default_replica_dir, mark_finished, open_run, save_fences
from elastic_runtime.core.errors import ElasticRuntimeError
from elastic_runtime.defaults import default_controller


def test_an_unfinished_run_is_continued_and_a_finished_one_is_not(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to resume"):
        open_run(tmp_path, resume=True)
    first = open_run(tmp_path, resume=False)
    assert not first.resumed
    again = open_run(tmp_path, resume=True)  # a controller killed before the end: the same run goes on
    assert again.resumed and again.run_id == first.run_id
    assert open_run(tmp_path, resume=False).run_id == first.run_id
    mark_finished(tmp_path, first.run_id)
    with pytest.raises(ValueError, match="its run finished"):
        open_run(tmp_path, resume=True)
    assert open_run(tmp_path, resume=False).run_id != first.run_id


def test_the_default_replica_folder_follows_the_run_folder(tmp_path: Path) -> None:
    assert default_replica_dir(tmp_path / "a") == default_replica_dir(tmp_path / "x" / ".." / "a")
    assert default_replica_dir(tmp_path / "a") != default_replica_dir(tmp_path / "b")
    assert default_replica_dir(tmp_path / "a").startswith("/dev/shm/elastic-runtime-")


def test_the_fences_survive_a_controller_and_stay_with_the_finished_run(tmp_path: Path) -> None:
    first = open_run(tmp_path, resume=False)
    assert (first.generation, first.fences) == (0, {})
    save_fences(tmp_path, first.run_id, 3, {1: 6, 2: 11})
    again = open_run(tmp_path, resume=True)  # the controller was killed; --resume
    assert (again.run_id, again.generation, again.fences) == (first.run_id, 3, {1: 6, 2: 11})
    # The resumed controller (serving briefly; no worker comes) numbers its generations after the old ones and
    # keeps the fences.
    config = LaunchConfig(command=[], nprocs=2, run_dir=str(tmp_path), resume=True, secret="s3cret")
    resumed = default_controller(config)
    anyio.run(against, resumed, lambda port: None)
    assert (resumed.group.generation, resumed.group.fences) == (3, {1: 6, 2: 11})
    mark_finished(tmp_path, first.run_id)
    assert json.loads((tmp_path / "run.json").read_text())["fences"] == {"1": 6, "2": 11}
    assert open_run(tmp_path, resume=False).fences == {}  # a new run starts with none


# --- replica folders nobody needs (runtime/cluster/leftovers.py) ------------------------------------------------


def test_a_worker_at_start_removes_folders_of_finished_runs_and_of_gone_processes(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    finished_run, unfinished_run = tmp_path / "finished", tmp_path / "unfinished"
    finished_run.mkdir()
    unfinished_run.mkdir()
    mark_finished(finished_run, open_run(finished_run, resume=False).run_id)
    open_run(unfinished_run, resume=False)
    gone = subprocess.Popen(["true"])
    gone.wait()
    folders = {name: shm / f"elastic-runtime-{name}" for name in ("done", "open", "dead", "alive", "mine", "user")}
    for folder in folders.values():
        (folder / "worker-0").mkdir(parents=True)
    leftovers.claim(folders["done"], run_dir=str(finished_run))
    leftovers.claim(folders["open"], run_dir=str(unfinished_run))  # --resume reads it
    leftovers.claim(folders["dead"], pid=gone.pid)
    leftovers.claim(folders["alive"], pid=os.getpid())
    leftovers.claim(folders["mine"], pid=gone.pid)  # the sweeping worker's own: never
    removed = leftovers.sweep(shm, keep=folders["mine"])
    assert sorted(line.split(":")[0] for line in removed) == [str(folders["dead"]), str(folders["done"])], removed
    assert "finished" in "".join(removed) and f"process {gone.pid} is gone" in "".join(removed)
    assert {p.name for p in shm.iterdir()} == {f"elastic-runtime-{n}" for n in ("open", "alive", "mine", "user")}
    # The run folder gone, its replica folder goes too; a folder without an owner (a user's) is never touched.
    shutil.rmtree(unfinished_run)
    leftovers.sweep(shm, keep=folders["mine"])
    assert {p.name for p in shm.iterdir()} == {f"elastic-runtime-{n}" for n in ("alive", "mine", "user")}


def start_service_worker(controller_port: int, worker: int, secret: str, log: Path) -> subprocess.Popen[bytes]:
    """A worker the controller does not start, as a cluster starts one: under a parent of its own (``sh``), so
    its default replica folder is ``/dev/shm/elastic-runtime-<that parent's pid>``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env |= {
        "ELASTIC_CONTROLLER": f"127.0.0.1:{controller_port}",
        "ELASTIC_WORKER_ID": str(worker),
        auth.ENV_TOKEN: secret,
    }
    command = " ".join(worker_command(SERVICE_STEPS)) + f" > {log} 2>&1; true"  # sh stays: the parent
    return subprocess.Popen(["sh", "-c", command], env=env)


SERVICE_STEPS = 8


@pytest.mark.timeout(240)
def test_a_finished_service_run_leaves_no_replica_folder_in_dev_shm(tmp_path: Path) -> None:
    secret = os.urandom(16).hex()
    config = LaunchConfig(command=[], nprocs=2, run_dir=str(tmp_path / "run"), secret=secret)
    controller = default_controller(config)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(result=controller.run()), name="controller")
    thread.start()
    workers = []
    try:
        deadline = time.monotonic() + 60
        while not controller.port and time.monotonic() < deadline:
            time.sleep(0.01)
        workers = [start_service_worker(controller.port, k, secret, tmp_path / f"worker-{k}.log") for k in range(2)]
        folders = [Path(f"/dev/shm/elastic-runtime-{w.pid}") for w in workers]
        thread.join(200)
        assert not thread.is_alive(), "the run did not end in time"
        for w in workers:
            w.wait(60)
        assert outcome["result"].ok, outcome["result"].reason
        assert outcome["result"].step == SERVICE_STEPS
        logs = "".join((tmp_path / f"worker-{k}.log").read_text() for k in range(2))
        assert "removed the replica folder" in logs
        assert not [f for f in folders if f.exists()], [list(f.rglob("*")) for f in folders if f.exists()]
    finally:
        if thread.is_alive():
            controller.end(ElasticRuntimeError("the test failed"))
            thread.join(30)
        for w in workers:
            if w.poll() is None:
                w.kill()
            shutil.rmtree(f"/dev/shm/elastic-runtime-{w.pid}", ignore_errors=True)


@pytest.mark.timeout(240)
def test_a_finished_launch_run_leaves_no_replica_folder_in_dev_shm(tmp_path: Path) -> None:
    result = run_group(processes=2, steps=SERVICE_STEPS, run_dir=tmp_path, faults=[])
    assert result.ok and result.step == SERVICE_STEPS, result.reason
    # Each worker removed its own folder when told the run finished, the last one the run's folder too.
    logs = "".join(path.read_text() for path in (tmp_path / "workers").glob("worker-*.log"))
    assert logs.count("removed the replica folder") >= 2, logs[-3000:]
    assert not Path(default_replica_dir(tmp_path)).exists()
