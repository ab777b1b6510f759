"""A hard memory limit on each worker process: a memory cgroup of its own, which the kernel enforces (a worker
that goes over it is killed by the OOM killer, and the cgroup counts the kill). Not collected.

The test makes a parent cgroup (``Confinement``) and names it, with the limit, in the workers' environment; each
worker calls ``confine()`` first thing, so everything it allocates after its start is charged to its own cgroup:
a worker started by ``exec`` from its birth, one forked from the fork server from its fork (what it shares with
the server stays charged there). Not ``RLIMIT_AS``: JAX reserves far more virtual memory than it uses.

cgroup v1's ``memory`` controller where it is mounted writable (this machine, and CI's); else a writable cgroup v2
tree with the ``memory`` controller; else ``Confinement.make`` says why not.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ENV_PARENT = "ELASTIC_TEST_MEMORY_CGROUP"
ENV_LIMIT = "ELASTIC_TEST_MEMORY_LIMIT"
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def confine() -> None:
    """Move this process into a new cgroup under ``$ELASTIC_TEST_MEMORY_CGROUP`` limited to
    ``$ELASTIC_TEST_MEMORY_LIMIT`` bytes; nothing when the variable is unset."""
    parent = os.environ.get(ENV_PARENT)
    if not parent:
        return
    own = Path(parent) / f"pid-{os.getpid()}"
    own.mkdir()
    limit = os.environ[ENV_LIMIT]
    if (own / "memory.limit_in_bytes").exists():
        (own / "memory.limit_in_bytes").write_text(limit)
    else:
        (own / "memory.max").write_text(limit)
        (own / "memory.swap.max").write_text("0")
    (own / "cgroup.procs").write_text(str(os.getpid()))


@dataclass(frozen=True)
class Usage:
    """One worker's cgroup after its run: its peak charge (resident memory and page cache) and its OOM kills."""

    pid: int
    peak: int
    oom_kills: int


@dataclass(frozen=True)
class Confinement:
    parent: Path
    limit: int

    @classmethod
    def make(cls, limit: int) -> Confinement:
        for root, probe in ((V1, "memory.limit_in_bytes"), (V2, "cgroup.subtree_control")):
            if (root / probe).exists() and os.access(root, os.W_OK):
                parent = root / f"elastic-runtime-test-{uuid.uuid4().hex[:8]}"
                parent.mkdir()
                if root == V2:
                    (parent / "cgroup.subtree_control").write_text("+memory")
                return cls(parent, limit)
        raise RuntimeError(f"no writable memory cgroup here ({V1} nor {V2} with cgroup.subtree_control)")

    def environment(self) -> dict[str, str]:
        return {ENV_PARENT: str(self.parent), ENV_LIMIT: str(self.limit)}

    def usage(self) -> list[Usage]:
        """Every worker's cgroup, in the order of their pids."""
        found = []
        for own in sorted(self.parent.glob("pid-*"), key=lambda p: int(p.name[4:])):
            if (own / "memory.max_usage_in_bytes").exists():
                peak = int((own / "memory.max_usage_in_bytes").read_text())
                kills = _field(own / "memory.oom_control", "oom_kill")
            else:
                peak = int((own / "memory.peak").read_text())
                kills = _field(own / "memory.events", "oom_kill")
            found.append(Usage(int(own.name[4:]), peak, kills))
        return found

    def remove(self) -> None:
        """Remove the cgroups once their processes are gone (a dead worker's cgroup empties as it is reaped)."""
        for own in [*self.parent.glob("pid-*"), self.parent]:
            for attempt in range(100):
                try:
                    own.rmdir()
                    break
                except OSError:
                    if attempt == 99:
                        raise
                    time.sleep(0.1)


def _field(path: Path, name: str) -> int:
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return int(value)
    raise RuntimeError(f"{path} has no {name} line: this kernel does not count OOM kills there")
