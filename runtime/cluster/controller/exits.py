"""Waking the reaper when a worker process exits, instead of it looking at every process 50 times a second.

A process started here is watched through a pidfd, which turns readable once the process has exited (Linux 5.3);
one the fork server started is not the controller's child, and its exit code comes from the server's reader
thread, which calls :meth:`ExitWatch.notify`. One thread waits at a time (the reaper's): the watched descriptors
are closed by it, or by :meth:`ExitWatch.close` when none waits.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading

__all__ = ["ExitWatch"]


class ExitWatch:
    def __init__(self) -> None:
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pidfds: set[int] = set()
        self._lock = threading.Lock()
        self._waiting = False
        self._closing = False

    def watch(self, pid: int) -> None:
        """Wake the waiter when ``pid`` (a child of this process) exits."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # exited and reaped already: its exit is news now
            self.notify()
            return
        with self._lock:
            if self._closing:
                os.close(pidfd)
                return
            self._pidfds.add(pidfd)
        self.notify()  # the waiter's set of descriptors changed

    def notify(self) -> None:
        """Wake the waiter (thread-safe): a process exited, or what is watched changed."""
        with self._lock, contextlib.suppress(BlockingIOError):  # full: a wake is pending already
            if self._wake_write >= 0:  # closed: nobody waits (and the number may be another file's by now)
                os.write(self._wake_write, b"x")

    def wait(self, timeout: float) -> bool:
        """Block until a watched process exits or :meth:`notify` is called (True), or ``timeout`` seconds pass."""
        with self._lock:
            if self._closing:
                return True
            self._waiting = True
            pidfds = list(self._pidfds)
        try:
            poller = select.poll()
            poller.register(self._wake_read, select.POLLIN)
            for pidfd in pidfds:
                poller.register(pidfd, select.POLLIN)
            ready = [fd for fd, _ in poller.poll(timeout * 1000)]
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_read, 4096):
                    pass
            with self._lock:
                for pidfd in ready:
                    if pidfd in self._pidfds:  # that process exited: nothing more to hear from it
                        self._pidfds.discard(pidfd)
                        os.close(pidfd)
            return bool(ready)
        finally:
            with self._lock:
                self._waiting = False
                closing = self._closing
            if closing:
                self._close_all()

    def close(self) -> None:
        """Close every descriptor: now, or as the waiting thread returns (woken for it)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            waiting = self._waiting
        if waiting:
            self.notify()
        else:
            self._close_all()

    def _close_all(self) -> None:
        with self._lock:
            if self._wake_read < 0:
                return
            descriptors = [*self._pidfds, self._wake_read, self._wake_write]
            self._pidfds, self._wake_read, self._wake_write = set(), -1, -1
        for fd in descriptors:
            with contextlib.suppress(OSError):
                os.close(fd)
