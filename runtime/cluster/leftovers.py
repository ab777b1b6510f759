"""Replica folders in ``/dev/shm`` (host memory): who each one is for, and the removal of those no run needs.

A replica folder is ``/dev/shm/elastic-runtime-<...>``; ``owner.json`` in it says what keeps it useful:

- ``{"run_dir": PATH}`` (``launch``'s default folder, claimed by the controller): the run folder's run. Kept
  while that run is unfinished (``--resume`` reads it), removable once ``run.json`` says it finished or the
  run folder is gone.
- ``{"pid": PID}`` (a worker's default folder when the controller does not start it, named after the
  worker's parent, claimed by the worker): no later process finds a folder named after a parent that is gone.

A worker removes its own folder when the controller says the run finished (``Stop.finished``), and at start
removes every other folder whose owner says it is no longer needed (:func:`sweep`), logging each. A folder
without ``owner.json`` (one a user named, ``--replica-dir``; an older version's) is never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

from elastic_runtime.core.folders import COMPILE_CACHE_FOLDER, PROGRAMS_PREFIX

__all__ = ["OWNER_FILE", "claim", "remove", "sweep", "unneeded"]

log = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
PREFIX = "elastic-runtime-"


def claim(folder: str | os.PathLike[str], *, run_dir: str | None = None, pid: int | None = None) -> None:
    """Write ``folder``'s owner (a run folder or a process id), unless it has one already."""
    path = Path(folder) / OWNER_FILE
    if path.exists():
        return
    record = {"run_dir": str(Path(run_dir).resolve())} if run_dir is not None else {"pid": pid}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{OWNER_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def unneeded(folder: Path) -> str:
    """Why no run needs ``folder`` any more; "" when one may (or nothing says)."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(owner, dict):
        return ""
    run_dir = owner.get("run_dir")
    if isinstance(run_dir, str):
        try:
            record = json.loads((Path(run_dir) / "run.json").read_text())
        except FileNotFoundError:
            return f"its run folder {run_dir} holds no run any more"
        except (OSError, ValueError):
            return ""
        return f"its run ({run_dir}) finished" if isinstance(record, dict) and record.get("finished") else ""
    pid = owner.get("pid")
    if isinstance(pid, int) and pid > 0 and not _alive(pid):
        return f"its process {pid} is gone"
    return ""


def sweep(root: str | os.PathLike[str] = "/dev/shm", *, keep: str | os.PathLike[str] = "") -> list[str]:
    """Remove the replica folders under ``root`` that no run needs (``keep``: this process's own, never);
    returns one "PATH: why" per folder removed, each also logged."""
    removed = []
    mine = Path(keep).resolve() if keep else None
    for folder in sorted(Path(root).glob(f"{PREFIX}*")):
        if not folder.is_dir() or folder.resolve() == mine:
            continue
        why = unneeded(folder)
        if why:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(f"{folder}: {why}")
            log.info("removed the replica folder %s: %s", folder, why)
    return removed


def remove(folder: str | os.PathLike[str], name: str) -> None:
    """Remove this process's replica folder ``name`` in ``folder``, and ``folder`` once nothing but its owner
    record, its compile cache or the workers' kept programs (``runtime/core/programs.py``) is left in it."""
    base = Path(folder)
    shutil.rmtree(base / name, ignore_errors=True)
    with contextlib.suppress(OSError):
        left = {p.name for p in base.iterdir() if not p.name.startswith(PROGRAMS_PREFIX)}
        if left <= {OWNER_FILE, COMPILE_CACHE_FOLDER}:  # the last process of the run on this host
            shutil.rmtree(base, ignore_errors=True)
    log.info("removed the replica folder %s", base / name)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
