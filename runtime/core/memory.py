"""A process's resident memory, as the kernel counts it (``/proc/self/status``): what a worker reports with its
host copies, so that a run's memory per process can be checked against the state's size (docs/multiprocess.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from pathlib import Path

__all__ = ["can_hold", "resident", "return_freed_memory"]

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter

_FIELDS = {"VmHWM": "peak_rss", "VmRSS": "rss"}


def resident(status: Path = Path("/proc/self/status")) -> dict[str, int]:
    """``peak_rss`` (the high-water mark since the process started) and ``rss``, in bytes; empty where the
    kernel does not say (not Linux)."""
    try:
        text = status.read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in _FIELDS:
            out[_FIELDS[name]] = int(value.split()[0]) * 1024  # the kernel writes kB
    return out


def can_hold(nbytes: int, *, share: float = 0.5) -> bool:
    """Whether this process can take ``nbytes`` more: at most ``share`` of what it may still use, the least of the
    machine's available memory (``MemAvailable``) and its memory cgroup's room (its limit less its usage; cgroup v1
    or v2). True where the kernel does not say (not Linux)."""
    room: list[int] = []
    with contextlib.suppress(OSError, ValueError):  # what could be read is what counts
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError):
        room.append(_cgroup_room())
    return not room or nbytes <= share * min(room)


def _cgroup_room(cgroups: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int:
    """This process's memory cgroup's limit less its usage: v1's ``memory`` hierarchy where it has one, else v2's
    unified one. Raises OSError where neither can be read, ValueError where v2 says there is no limit ("max")."""
    paths = dict(line.split(":", 2)[1:] for line in cgroups.read_text().splitlines())
    v1 = next((path for controllers, path in paths.items() if "memory" in controllers.split(",")), None)
    if v1 is not None:
        folder, limit, usage = root / "memory" / v1.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes"
    else:
        folder, limit, usage = root / paths.get("", "/").lstrip("/"), "memory.max", "memory.current"
    return int((folder / limit).read_text()) - int((folder / usage).read_text())


def return_freed_memory(threshold: int = 1024 * 1024) -> None:
    """Have glibc give every allocation of ``threshold`` bytes or more its own mapping, returned to the kernel when
    freed. By default the threshold grows to the largest block freed (up to 32 MB), after which a worker's host
    copies of its shards (a new one each step, freed a step later, from several threads) come from malloc's heaps
    and stay resident once freed: measured, a worker's memory grew by a copy of its shards per step for steps.
    Nothing happens where the C library is not glibc.

    1 MiB, not the 128 KiB glibc starts from (the value here before): a small model's arrays (the demo's are 256
    KiB) were fresh pages every step too; its fresh states stepped at 1.11-1.22x the bare loop's at 128 KiB,
    0.94-1.05x at 1 MiB, and the peak memory was no higher with larger shards (docs/benchmarks.md, "Multi-process
    steady state").

    The cost falls on CPU devices, whose arrays are malloc's too: every fresh array is then pages faulted in
    and zeroed by the kernel. A worker's step writes its new state into a replaced one
    (``runtime/cluster/worker/spares.py``), and what is left is mostly the step's temporaries. Measured
    (docs/benchmarks.md, "Multi-process steady state"): at 64 MB of state a process, the step 1.23x the bare
    loop's with it, 0.98x without, for a peak memory per byte of state of 0.87 against 0.91 at 4 processes a
    slice and 1.46 against 1.82 at 2 (``rss_slope``). Workers skip it with ``ELASTIC_RETURN_FREED_MEMORY=0``.
    On GPUs and TPUs the arrays are not malloc's, and only the host copies are affected."""
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError) as exc:
        log.debug("mallopt unavailable: %s", exc)
