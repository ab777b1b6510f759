"""The run folder names the run: its id, whether it finished, and where its replica files live.

A controller that crashed (``kill -9``) or was stopped (SIGTERM) leaves a run that the same command with
the same run folder continues: the id is kept in ``run.json`` until the run finishes, and the default
replica folder is derived from the run folder's path (not from a process id or a time), so a new controller
finds the replicas its predecessor's workers wrote. Replicas carry the id; those of any other run are
never restored (``storage/replicas.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunRecord", "default_replica_dir", "mark_finished", "open_run"]

RUN_FILE = "run.json"


@dataclass(frozen=True)
class RunRecord:
    """The run a controller drives: ``resumed`` when it continues one an earlier controller left unfinished."""

    run_id: str
    resumed: bool


def default_replica_dir(run_dir: Path) -> str:
    """``/dev/shm/elastic-runtime-<hash of the run folder's path>``: the same folder for every controller of
    the run, a different one for every other run folder."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return f"/dev/shm/elastic-runtime-{digest}"


def open_run(run_dir: Path, *, resume: bool) -> RunRecord:
    """The run in ``run_dir``: an unfinished one is continued, otherwise a new one starts (new id).

    Raises:
        ValueError: ``resume`` and ``run_dir`` holds no unfinished run.
    """
    path = run_dir / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {}
    if isinstance(record, dict) and isinstance(record.get("run_id"), str) and not record.get("finished"):
        return RunRecord(run_id=record["run_id"], resumed=True)
    if resume:
        why = "its run finished" if record else f"it holds no {RUN_FILE}"
        raise ValueError(f"--resume: nothing to resume in {run_dir} ({why})")
    run_id = uuid.uuid4().hex
    _write(path, {"run_id": run_id, "finished": False})
    return RunRecord(run_id=run_id, resumed=False)


def mark_finished(run_dir: Path, run_id: str) -> None:
    """The run reached its target: the next launch into this folder is a new run."""
    _write(run_dir / RUN_FILE, {"run_id": run_id, "finished": True})


def _write(path: Path, record: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # a crash mid-write leaves the old record, never half of one
