"""A worker process's start: JAX configured for a group, the secret read once, the link opened, the loop run."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from elastic_runtime.cluster import auth, leftovers
from elastic_runtime.cluster.protocol import ENV_CONTROLLER, Noticed
from elastic_runtime.cluster.worker.boundary import ScriptHandlers
from elastic_runtime.cluster.worker.forming import shared_cache
from elastic_runtime.cluster.worker.link import ControllerLink, connect
from elastic_runtime.cluster.worker.loop import Worker
from elastic_runtime.cluster.worker.settings import WorkerSettings
from elastic_runtime.core.bus import Subscription
from elastic_runtime.core.errors import AuthenticationFailed, ConfigError, UnsupportedInMode
from elastic_runtime.core.events import never_published
from elastic_runtime.core.executor import RunResult
from elastic_runtime.core.job import TrainJob
from elastic_runtime.core.programs import ProgramStore
from elastic_runtime.storage.replicas import ReplicaFiles

log = logging.getLogger(__name__)

# Watches the host's own notices (a metadata server's address) until the process ends, handing each notice's
# JSON to the callable it is given; ``elastic_runtime.defaults.watch_own_host`` is one.
NoticeWatch = Callable[[str, Callable[[bytes], None]], None]


def _log_to_stderr() -> None:
    """The runtime's own log lines (joins, compile and restore times) to stderr, the worker's log file, at INFO,
    whatever the script did with the root logger: a program that configures logging first (MaxText does) made
    ``basicConfig`` a no-op, and its WARNING level hid them."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s worker %(name)s: %(message)s"))
    logger = logging.getLogger("elastic_runtime")
    logger.handlers = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


_ran = False  # a worker runs one job: its process was one member of the launch's group
# How long a finished run waits for step threads abandoned in a dead peer's collective to end before run() returns
# anyway: most have long ended; one still blocked only changes how the process exits (exit_without_destructors).
_BLOCKED_WAIT_S = 2.0


def exit_without_destructors() -> None:
    """When the script ends, end the process with ``os._exit``: a step thread still blocked inside XLA would
    see XLA's destructors run under it at a normal exit. The exit code is 1 if an exception ended the script,
    else 0 (a ``sys.exit(n)``'s code is not seen)."""
    failed: list[bool] = []
    hook = sys.excepthook

    def note(kind: type[BaseException], value: BaseException, trace: Any) -> None:
        failed.append(True)
        hook(kind, value, trace)

    def end() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if failed else 0)

    sys.excepthook = note
    atexit.register(end)


def is_worker() -> bool:
    """Whether this process was started by ``elastic-runtime launch``."""
    return ENV_CONTROLLER in os.environ


def run_worker(
    job: TrainJob,
    steps: int,
    *,
    handlers: Sequence[Subscription[Any]] = (),
    handler_timeout: float | None = 30.0,
    watch_notices: NoticeWatch | None = None,
    script_settings: Mapping[str, str] | None = None,
    fingerprint_every: int | None = None,
    gather: bool = False,
) -> RunResult:
    """Train ``job`` to ``steps`` committed steps as one worker of ``elastic-runtime launch``; returns this
    process's :class:`RunResult` once the whole group finished. Its state is None unless ``gather`` (or the launch's
    ``--result``): then the lead (process 0) holds the whole final state, gathered from every process's shards
    (every process must pass the same ``gather``: each takes part in the gather).

    ``handlers``: the script's own subscriptions; they run for the group's events the controller forwards, at
    a step boundary every member agrees on (``runtime/cluster/worker/boundary.py``). ``watch_notices``: with
    ``ELASTIC_METADATA_HOST`` set, watches this host's notices and the worker forwards them to the controller.
    ``script_settings``: what the script set of what the launch sets for the group (``Hello.settings``).
    ``fingerprint_every``: 1 compares the slices' copies of the state after every step, before it commits (silent
    data corruption; ``RuntimeConfig.fingerprint_every``); None or 0: not compared.

    ``ElasticRuntime.run`` calls it when the process was started by ``elastic-runtime launch``. It drops any
    backend the script created, then configures the CPU device count, gloo collectives and recoverability.
    Once the group finished, the process leaves it (the group's arrays go with its backend; the script may use
    JAX again on a fresh local one) and the script goes on after ``run()``. A run that ends otherwise (a failure
    the controller ends the run with, a signal, a replacement) exits the process (``os._exit``). With a step
    thread still blocked in a dead peer's collective, the process ends with ``os._exit`` once the script does
    (:func:`exit_without_destructors`).

    Raises:
        RuntimeError: not started by ``elastic-runtime launch`` (no controller address in the environment).
        ConfigError: ``fingerprint_every`` more than 1.
    """
    global _ran
    if fingerprint_every is not None and fingerprint_every > 1:
        # The replay of a divergence goes back one step (the state the step read, never committed over).
        raise ConfigError(
            f"fingerprint_every={fingerprint_every} under `elastic-runtime launch`: the slices are compared after "
            "every step (1) or not at all (0, unset)"
        )
    if not is_worker():
        raise RuntimeError(f"run_worker needs {ENV_CONTROLLER}: start the script with `elastic-runtime launch`")
    if _ran:
        raise UnsupportedInMode(
            "a second run in a worker of `elastic-runtime launch`: this process's group has finished its run; run "
            "another job (a fault-free reference, say) outside the launch (RunResult.mode says which mode ran)"
        )
    _ran = True
    import jax
    import jax.extend.backend

    _log_to_stderr()
    never = never_published("launch", [sub.event_type for sub in handlers])
    if never:
        log.warning("handlers subscribed to events a worker under launch never gets: %s", "; ".join(never))
    # The script may have touched a device already (a default mesh policy does): that local backend must go
    # before the device count is set and the process joins a group.
    jax.extend.backend.clear_backends()
    settings = WorkerSettings.from_env()
    jax.config.update("jax_num_cpu_devices", settings.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Without it the coordination service ends every survivor when one process dies.
    jax.config.update("jax_enable_recoverability", True)
    cache = settings.compile_cache
    if cache:
        # Every generation compiles the same step for the same layout again (new backend); with a persistent
        # cache the survivors and the replacement load it instead of running XLA.
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    worker = settings.worker
    code = 1
    folder = settings.replica_folder(os.getppid())
    in_memory = folder.startswith("/dev/shm/")
    if in_memory:
        # Folders of runs that finished or whose processes are gone hold host memory nobody will read.
        leftovers.sweep(keep=folder)
        if not settings.replica_dir:  # named after the parent: useless once it is gone
            leftovers.claim(folder, pid=os.getppid())
    replicas = ReplicaFiles(folder, f"worker-{worker}")
    # Read once and dropped from the environment, so that what the script starts does not inherit it.
    secret = auth.load_secret()
    os.environ.pop(auth.ENV_TOKEN, None)
    try:
        if secret is None:
            raise AuthenticationFailed(f"no secret to prove to the controller: set {auth.ENV_TOKEN}")
        link = connect(settings.controller, secret, settings.connect_s)
        script = ScriptHandlers(handlers, handler_timeout=handler_timeout) if handlers else None
        # Files of compiled programs are signed with the run's secret; kept=False: traced at every re-forming.
        programs = ProgramStore(secret) if settings.keep_programs else None
        loop = Worker(
            job,
            steps,
            settings=settings,
            link=link,
            replicas=replicas,
            script=script,
            programs=programs,
            script_settings=dict(script_settings or {}),
            fingerprint=fingerprint_every == 1,
            gather=gather,
        )
        if watch_notices is not None and settings.metadata_host:
            forward_notices(watch_notices, settings.metadata_host, link, loop)
        code = loop.serve()
        replicas.wait()
        finished = loop.stopped_by is not None and loop.stopped_by.finished
        if in_memory and finished:
            leftovers.remove(folder, f"worker-{worker}")  # the run finished: no resume will read them
        shared = loop.programs.folder if shared_cache(loop) is not None else None  # forming.programs_folder
        if finished and loop.process_id == 0 and shared is not None:
            shutil.rmtree(shared, ignore_errors=True)  # the run is over: a resumed one keeps its programs anew
        if finished and code == 0 and loop.result is not None:
            if loop.still_blocked(_BLOCKED_WAIT_S):
                # Its thread is a daemon, so nothing waits for it; but XLA's destructors must not run under it.
                log.info("worker %d: a step thread is still blocked in a dead peer's collective", worker)
                exit_without_destructors()
            loop.leave()
            if script is not None:
                script.finished(loop)
            log.info("worker %d: the group finished; run() returns to the script", worker)
            return loop.result
    except Exception:
        log.exception("worker %d failed", worker)
    sys.stdout.flush()
    sys.stderr.flush()
    # Abandoned step threads are blocked inside XLA; a normal exit would run destructors under them.
    os._exit(code)


def forward_notices(watch: NoticeWatch, metadata_host: str, link: ControllerLink, process: Worker) -> None:
    """Run ``watch`` in a daemon thread; each notice it hands over goes to the controller as ``Noticed`` once
    the worker is in a group (its ``Hello`` must be the connection's first message)."""

    def forward(event: bytes) -> None:
        process.in_a_group.wait()
        link.send(Noticed(worker=process.worker, event=msgspec.Raw(event)))

    def run() -> None:
        try:
            watch(metadata_host, forward)
        except Exception:  # a notice source must not take the worker down
            log.exception("worker %d: the metadata watcher at %s ended", process.worker, metadata_host)

    threading.Thread(target=run, name="notices", daemon=True).start()
