"""Worker processes forked from one that has imported JAX already, so that a spare started after a loss is ready
in a fraction of a second instead of after JAX's import (about 2 s on a quiet machine, several under load), and
the first workers of a run share one import instead of making one each.

Two losses against one warm spare used to wait for that import: the second seat's spare was started cold. The
controller also waits for the server before it starts the first workers (``shell.py``): on 2 cores a run's first
step came 2.0 s sooner (docs/benchmarks.md, "Start-up").

The server (:func:`serve` in ``python -c``, started by the controller through ``deathsig.py``)
imports JAX and the runtime's worker side once, creates no JAX backend and starts no thread, then reads one request
a line on stdin: a command, its environment and its log file. It forks; the child takes a process group of its own,
dies with the server (``PR_SET_PDEATHSIG``; the server dies with the controller), writes to its log, takes the
environment whole and runs the command as ``python`` would (``-m module`` or a script). The server answers each
child's pid, and each exit code as it reaps the child, a JSON line each on stdout.

A command is forked only if it runs the Python the server runs (its first word is that executable) with ``-m
module`` or a ``.py`` script and no other interpreter option; anything else, and anything asked before the
server is ready, is started as a new process as before. JAX reads its configuration from the environment at
import, so the server gets the workers' environment, less what differs from one worker to the next (which the
runtime reads only at run time).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from elastic_runtime.compat.xla import set_flags as set_xla_flags

__all__ = ["ForkServer", "ForkedProcess", "forkable"]

log = logging.getLogger(__name__)

# What the server imports for its children: JAX and the worker side of the runtime (by name: the controller's
# code uses nothing of the worker's), which are most of a worker's start-up.
_PRELOADED = ("jax", "jax.numpy", "elastic_runtime.cluster.worker.loop")
_ANSWER_S = 10.0  # how long a request may wait for the server's answer before the process is started as before


def forkable(command: list[str]) -> bool:
    """Whether ``command`` runs Python with ``-m module`` or a ``.py`` script and nothing else before them."""
    if len(command) < 2 or not Path(command[0]).name.startswith("python"):
        return False
    return (command[1] == "-m" and len(command) > 2) or command[1].endswith(".py")


class ForkedProcess:
    """A worker the server forked: what the controller uses of a ``subprocess.Popen`` (``pid``, ``poll``,
    ``wait``, ``kill``). Its exit code comes from the server, which reaps it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def exited(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:  # reaped, its pid may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class ForkServer:
    """The controller's side: starts the server and asks it for workers.

    Args:
        command: the workers' command (its interpreter runs the server).
        env: the environment the workers share.
        log_path: the server's own log (its imports' warnings, a failed fork).
        wrap: how a process is started so that it dies with the controller (``dying_with_controller``).
    """

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        wrap: Callable[[list[str]], list[str]],
        on_exit: Callable[[], None] = lambda: None,
    ) -> None:
        self._log_path = log_path
        self._on_exit = on_exit  # told after a child's exit code came in (it is not the controller's child)
        with open(log_path, "wb") as log_file:
            self._server = subprocess.Popen(
                wrap([command[0], "-c", f"from {__name__} import serve; serve()"]),
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                process_group=0,  # as a worker: Ctrl-C spares it, and no autogroup of its own (processes.py)
            )
        self._ready = threading.Event()
        self._settled = threading.Event()  # ready, or gone before it was
        self._answers: queue.Queue[int] = queue.Queue()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exit codes of children reaped before their pid was answered
        self._asking = threading.Lock()  # one request and its answer at a time
        self._lock = threading.Lock()  # the children and early exit codes, held briefly
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._server.poll() is None

    def wait_ready(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the server to have imported JAX; a server gone or slower by then is
        logged (workers then start as new processes until it is ready)."""
        self._settled.wait(timeout)
        if not self.ready:
            log.warning(
                "the fork server is not ready after %.0f s (%s): workers start as new processes until it is",
                timeout,
                self._log_path,
            )

    def spawn(self, command: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess | None:
        """A forked worker running ``command``; None when the server cannot fork it (not ready, or gone)."""
        if not self.ready:
            return None
        request = json.dumps({"argv": command[1:], "env": env, "log": str(log_path)}) + "\n"
        with self._asking:
            try:
                assert self._server.stdin is not None
                self._server.stdin.write(request.encode())
                self._server.stdin.flush()
                pid = self._answers.get(timeout=_ANSWER_S)
            except (OSError, queue.Empty) as exc:
                log.warning("the fork server did not answer (%s); workers are started as new processes", exc)
                self.close()
                return None
        child = ForkedProcess(pid)
        with self._lock:
            self._children[pid] = child
            code = self._early.pop(pid, None)
        if code is not None:
            child.exited(code)
            self._on_exit()
        return child

    def _read(self) -> None:
        assert self._server.stdout is not None
        for line in self._server.stdout:
            try:
                answer = json.loads(line)
            except ValueError:  # something the server's imports printed, not an answer
                log.warning("fork server: %s", line.decode(errors="replace").rstrip())
                continue
            if "ready" in answer:
                self._ready.set()
                self._settled.set()
            elif "started" in answer:
                self._answers.put(answer["started"])
            else:
                pid, code = answer["exited"], answer["code"]
                with self._lock:
                    child = self._children.get(pid)
                    if child is None:
                        self._early[pid] = code
                if child is not None:
                    child.exited(code)
                    self._on_exit()
        self._ready.clear()
        self._settled.set()
        # The server is gone, and its children with it (their death signal): none is reaped by anyone now.
        with self._lock:
            orphans = [c for c in self._children.values() if c.returncode is None]
        for child in orphans:
            child.exited(-signal.SIGKILL)
        self._on_exit()

    def close(self) -> None:
        """Stop the server (its children still running die with it)."""
        if self._server.poll() is None:
            self._server.kill()
            self._server.wait()
        self._reader.join(timeout=5)  # it reads to the end of the server's output, which ended with it
        for pipe in (self._server.stdin, self._server.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


# --- the server ---------------------------------------------------------------------------------------------


def serve() -> None:
    """Import what every worker imports, then fork a worker per request until stdin closes."""
    for module in _PRELOADED:
        importlib.import_module(module)
    assert threading.active_count() == 1, "forking is safe only with no other thread"
    answers = sys.stdout.buffer
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select below
    _answer(answers, {"ready": True})
    stdin, pending = sys.stdin.fileno(), b""
    while True:
        readable, _, _ = select.select([stdin, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
        if stdin in readable:
            data = os.read(stdin, 1 << 20)
            if not data:
                return  # the controller is done (or gone)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                server = os.getpid()
                pid = os.fork()
                if pid == 0:
                    os.close(wake_read)
                    os.close(wake_write)
                    raise SystemExit(_run_child(json.loads(line), server))
                _answer(answers, {"started": pid})
        _reap(answers)


def _reap(answers: IO[bytes]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _answer(answers, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _answer(answers: IO[bytes], message: dict[str, Any]) -> None:
    answers.write((json.dumps(message) + "\n").encode())
    answers.flush()


def _run_child(request: dict[str, Any], server: int) -> int | str | None:
    """In the forked child: become the worker ``request`` names, as ``python ARGV...`` would start it; dies with
    ``server``, the pid it was forked by (read before the fork: the server may die before the child runs, and
    ``getppid()`` then names whoever adopted it, whose death would never come)."""
    from elastic_runtime.cluster.controller.deathsig import die_with_parent

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setpgid(0, 0)  # a group of its own, as a worker started without the fork server (processes.py)
    die_with_parent(server)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])
    set_xla_flags()  # read by XLA when this worker's first backend starts, from its own environment
    argv: list[str] = request["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy sets argv[0] to the module's file
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit:
        return exit.code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0
