"""The run folder names the run: an unfinished run is continued, a finished one is followed by a new run,
and the default replica folder follows the run folder, not the process."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from test_auth import against

from runtime.cluster.config import LaunchConfig
from runtime.cluster.controller.runfolder import default_replica_dir, mark_finished, open_run, save_fences
from runtime.defaults import default_controller


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
