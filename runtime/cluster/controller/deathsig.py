"""Run a command that dies with the controller: ``python deathsig.py PARENT_PID COMMAND...`` (Linux).

Sets ``PR_SET_PDEATHSIG`` to SIGKILL, then execs COMMAND in the same process (same pid), so the worker is
killed when the controller dies, however it dies (``kill -9`` included) and even when the worker is stopped
(SIGSTOP): SIGKILL needs no cooperation. The setting survives exec.

A wrapper run by path, not ``Popen(preexec_fn=...)``: a ``preexec_fn`` makes ``subprocess`` fork the
controller, whose JAX threads make that unsafe (JAX warns that it may deadlock). Run by path with ``-S`` it
imports nothing of this package and starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` (its parent now) dies; exit at once if it is gone already."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the line above: nothing would kill us later
        sys.exit(f"deathsig: the parent (pid {parent}) is gone; not starting")


def main(argv: list[str]) -> None:
    parent, command = int(argv[0]), argv[1:]
    die_with_parent(parent)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
