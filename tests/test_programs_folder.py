"""Where a group keeps its compiled programs: beside this host's replica files, or in a compile cache every host
shares, so that a replacement on a new host loads them rather than compiling (cluster/worker/forming.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from elastic_runtime.cluster.worker.forming import programs_folder, shared_cache


def worker(replicas: Path, compile_cache: str) -> Any:
    return SimpleNamespace(
        replicas=SimpleNamespace(directory=replicas), settings=SimpleNamespace(compile_cache=compile_cache)
    )


def test_launch_keeps_them_beside_the_replica_files_where_its_compile_cache_is_too(tmp_path: Path) -> None:
    replicas = tmp_path / "shm" / "elastic-runtime-1"
    assert programs_folder(worker(replicas, str(replicas / "xla-cache")), "programs-ab") == replicas / "programs-ab"
    assert programs_folder(worker(replicas, ""), "programs-ab") == replicas / "programs-ab"
    # and so process 0 leaves them when the run finishes (boot.py): the replica folder's own cleanup takes them
    assert shared_cache(worker(replicas, str(replicas / "xla-cache"))) is None


def test_a_compile_cache_the_hosts_share_holds_them_for_a_replacement_on_a_new_host(tmp_path: Path) -> None:
    replicas, shared = tmp_path / "shm" / "elastic-runtime-1", tmp_path / "nfs" / "xla-cache"
    assert programs_folder(worker(replicas, str(shared)), "programs-ab") == shared / "programs-ab"
    assert shared_cache(worker(replicas, str(shared))) == shared  # process 0 removes them when the run finishes
    # Not a local folder: the files of kept programs are read and written as files, so they stay on the host.
    assert programs_folder(worker(replicas, "gs://bucket/cache"), "programs-ab") == replicas / "programs-ab"


def test_no_folder_named_keeps_them_in_memory(tmp_path: Path) -> None:
    assert programs_folder(worker(tmp_path, str(tmp_path / "elsewhere")), "") is None
