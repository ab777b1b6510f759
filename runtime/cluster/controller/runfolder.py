"""The run folder names the run: its id, whether it finished, and where its replica files live.

A controller that crashed (``kill -9``) or was stopped (SIGTERM) leaves a run that the same command with
the same run folder continues: the id is kept in ``run.json`` until the run finishes, and the default
replica folder is derived from the run folder's path (not from a process id or a time), so a new controller
finds the replicas its predecessor's workers wrote. Replicas carry the id; those of any other run are
never restored (``storage/replicas.py``).

``run.json`` also keeps the run's fencing record (see ``docs/multiprocess.md``, *Fencing*): the newest
generation formed, and for each superseded generation the step the group went on from (its fence). A resumed
controller numbers its generations after the old ones and sends the same fences, so a replica an old
generation wrote past its fence is never restored, whichever controller formed that generation.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RunRecord", "default_replica_dir", "mark_finished", "open_run", "save_fences"]

RUN_FILE = "run.json"


@dataclass(frozen=True)
class RunRecord:
    """The run a controller drives: ``resumed`` when it continues one an earlier controller left unfinished."""

    run_id: str
    resumed: bool
    generation: int = 0  # the newest generation an earlier controller of this run formed
    fences: dict[int, int] = field(default_factory=dict)  # generation -> the step the group went on from


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
        fences = record.get("fences") or {}
        return RunRecord(
            run_id=record["run_id"],
            resumed=True,
            generation=int(record.get("generation", 0)),
            fences={int(g): int(step) for g, step in fences.items()},
        )
    if resume:
        why = "its run finished" if record else f"it holds no {RUN_FILE}"
        raise ValueError(f"--resume: nothing to resume in {run_dir} ({why})")
    run_id = uuid.uuid4().hex
    _write(path, {"run_id": run_id, "finished": False})
    return RunRecord(run_id=run_id, resumed=False)


def save_fences(run_dir: Path, run_id: str, generation: int, fences: dict[int, int]) -> None:
    """Record the newest ``generation`` formed and every superseded generation's fence (before any worker of
    the next generation may write a replica: a controller killed right after still knows them)."""
    record = {"run_id": run_id, "finished": False, "generation": generation}
    _write(run_dir / RUN_FILE, record | {"fences": {str(g): step for g, step in sorted(fences.items())}})


def mark_finished(run_dir: Path, run_id: str) -> None:
    """The run reached its target: the next launch into this folder is a new run. Its fences stay in the
    record (what a reader of the finished run may want to check)."""
    try:
        record = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        record = {}
    kept = {k: record[k] for k in ("generation", "fences") if isinstance(record, dict) and k in record}
    _write(run_dir / RUN_FILE, {"run_id": run_id, "finished": True} | kept)


def _write(path: Path, record: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # a crash mid-write leaves the old record, never half of one
