"""``elastic_runtime.core.memory.return_freed_memory``: what glibc does with a block once it is told, and the worker
setting that skips it (``ELASTIC_RETURN_FREED_MEMORY=0``). Each check runs in a process of its own: malloc's settings
are the whole process's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runtime.cluster.protocol import ENV_CONTROLLER, ENV_RETURN_FREED_MEMORY, ENV_WORKER
from elastic_runtime.cluster.worker.settings import WorkerSettings
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.memory import _cgroup_room

# A 4 MiB block freed raises glibc's own threshold past it: a 2 MiB block then comes from the heap, unless the
# threshold was fixed at 1 MiB, which gives it a mapping of its own (returned to the kernel when freed); a 256 KiB
# block (the demo model's arrays are that size) comes from the heap either way.
_PROBE = """
import ctypes, sys
from elastic_runtime.core.memory import return_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[1] == "told":
    return_freed_memory()
libc.free(libc.malloc(4 << 20))
blocks = [libc.malloc(2 << 20), libc.malloc(256 << 10)]
heap = next(line for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
low, high = (int(x, 16) for x in heap.split()[0].split("-"))
print(" ".join("heap" if low <= block < high else "mapped" for block in blocks))
"""


def where_blocks_go(told: bool) -> str:
    argv = [sys.executable, "-c", _PROBE, "told" if told else "default"]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc/self/maps")
def test_once_told_a_block_of_1_mib_or_more_is_mapped_on_its_own_and_a_smaller_one_comes_from_the_heap() -> None:
    assert where_blocks_go(told=True) == "mapped heap"
    assert where_blocks_go(told=False) == "heap heap"


def test_workers_return_freed_memory_unless_their_environment_says_0() -> None:
    base = {ENV_CONTROLLER: "127.0.0.1:1", ENV_WORKER: "0"}
    assert WorkerSettings.from_env(base).return_freed_memory
    assert not WorkerSettings.from_env(base | {ENV_RETURN_FREED_MEMORY: "0"}).return_freed_memory
    with pytest.raises(ConfigError, match=ENV_RETURN_FREED_MEMORY):
        WorkerSettings.from_env(base | {ENV_RETURN_FREED_MEMORY: "sometimes"})


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroups_room_is_its_limit_less_its_usage_in_either_cgroup_version(tmp_path: Path, version: str) -> None:
    # The lead gathers the whole final state only where it fits (``can_hold``): a worker confined to less than the
    # state (tests/multiprocess/test_sharded_init.py) was OOM-killed when its cgroup was not read.
    cgroups = tmp_path / "cgroup"
    if version == "v1":
        cgroups.write_text("9:name=systemd:/\n4:memory:/jobs/w1\n0::/\n")
        folder, limit, usage = tmp_path / "memory" / "jobs" / "w1", "memory.limit_in_bytes", "memory.usage_in_bytes"
    else:
        cgroups.write_text("0::/jobs/w1\n")
        folder, limit, usage = tmp_path / "jobs" / "w1", "memory.max", "memory.current"
    folder.mkdir(parents=True)
    (folder / limit).write_text("1000\n")
    (folder / usage).write_text("300\n")
    assert _cgroup_room(cgroups, tmp_path) == 700
    (folder / limit).write_text("max\n")
    with pytest.raises(ValueError):  # v2's "no limit"; v1 writes a huge number instead
        _cgroup_room(cgroups, tmp_path)
