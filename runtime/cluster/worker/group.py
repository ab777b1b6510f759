"""Joining and leaving a generation's ``jax.distributed`` group, whose coordination service the controller hosts,
and meeting its other members there before a collective."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any

from elastic_runtime.cluster.protocol import Form
from elastic_runtime.cluster.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

# How often a worker waiting in the group's start looks whether the controller gave that group up.
_GIVEN_UP_POLL_S = 0.02
# How often a member waiting at a meeting point asks the coordination service who has come (0.2-0.3 ms a call):
# soon at first (a restore from memory meets within milliseconds), then more and more rarely (a durable read).
_MEET_FIRST_POLL_S = 0.001
_MEET_LAST_POLL_S = 0.05


def join_group(form: Form, settings: WorkerSettings, given_up: Callable[[], bool]) -> bool:
    """Connect this process to the group's coordination service, which the controller hosts; False when
    ``given_up()`` turned true first.

    ``jax.distributed.initialize`` would start the service inside process 0; measured here, when process 0
    is then killed every survivor's coordination client polls an error and terminates its process (and a
    Python error callback cannot stand in: jaxlib 0.10.2 aborts casting its status). With the service in
    the never-restarted controller, any worker, process 0 included, can die without taking the others down.
    This uses the same private entry points ``initialize`` uses, through :mod:`elastic_runtime.compat.jax`.

    The connect waits for every seat of the group. When a member is lost before it took its seat and the
    controller forms the next generation without it, the connect can neither be cancelled nor be left to fail
    (a client that fails to connect terminates its process): it goes on in its thread, and the controller
    fills the lost seats with stand-ins (``standin.py``) once every member has left the group, so that it
    returns and is shut down.
    """
    from elastic_runtime.compat import jax as jax_compat

    state = jax_compat.distributed_state()
    if state.client is not None:
        raise RuntimeError("jax.distributed is already initialized in this process")
    client = jax_compat.distributed_runtime_client(
        form.coordinator,
        form.process_id,
        init_timeout=settings.jax_init_s,
        use_compression=True,
        heartbeat_timeout=settings.jax_heartbeat_s,
        shutdown_timeout=settings.jax_shutdown_s,
    )
    connecting: Future[None] = Future()

    def connect() -> None:
        try:
            client.connect()
            connecting.set_result(None)
        except BaseException as exc:  # raised in the caller's thread, or logged once given up
            connecting.set_exception(exc)

    threading.Thread(target=connect, name=f"join-{form.generation}", daemon=True).start()
    while True:
        try:
            connecting.result(timeout=_GIVEN_UP_POLL_S)
            break
        except FutureTimeout:
            if given_up():
                connecting.add_done_callback(partial(_leave_given_up, client, form.generation))
                return False
    state.client = client
    state.coordinator_address = form.coordinator
    state.process_id = form.process_id
    state.num_processes = form.num_processes
    return True


def _leave_given_up(client: Any, generation: int, connecting: Future[None]) -> None:
    """In the connect's thread as it returns (the lost seats filled by stand-ins): leave the given-up group."""
    if connecting.exception() is not None:
        log.warning("generation %d, given up, ended: %s", generation, connecting.exception())
        return
    _shut_down(client, f"generation {generation}, given up")
    log.info("left generation %d, given up before it formed", generation)


def leave_group() -> None:
    """Disconnect from the old group's service (still up in the controller, so this returns at once)."""
    from elastic_runtime.compat import jax as jax_compat

    state = jax_compat.distributed_state()
    client, state.client = state.client, None
    if client is not None:
        _shut_down(client, "the old group")


def _shut_down(client: Any, group: str) -> None:
    """Disconnect ``client``: its group is broken or was never formed, so its shutdown may complain (logged)."""
    try:
        client.shutdown()
    except Exception as exc:
        log.warning("leaving %s: %s: %s", group, type(exc).__name__, exc)


def meet(name: str, timeout_s: float, abandoned: threading.Event | None = None) -> None:
    """Wait until every process of the group has reached ``name``, through the group's coordination service.

    Called before a collective that follows host work of uneven length (a restore's reads of its shards, a
    final durable write): a member that came early waits here, not inside the collective, so gloo's collective
    timeout (``runtime/compat/xla.py``) has only the members' compute to cover, which the hang timeout bounds,
    and can be short. A meeting is polled rather than a ``wait_at_barrier``: this thread may be abandoned (a
    peer died), and a client's calls after its shutdown neither fail nor return their answers, so the wait
    ends when the worker leaves the group (``leave_group``), or sooner when ``abandoned`` is set.

    Raises:
        RuntimeError: the worker left the group, or abandoned the wait, first.
        TimeoutError: not every process came within ``timeout_s``.
    """
    from elastic_runtime.compat import jax as jax_compat

    state = jax_compat.distributed_state()
    client, members = state.client, state.num_processes
    if client is None:
        raise RuntimeError(f"meeting {name!r}: not in a group")
    key = f"meet/{name}/"
    client.key_value_set(f"{key}{state.process_id}", "")
    deadline = time.monotonic() + timeout_s
    pause = _MEET_FIRST_POLL_S
    while len(client.key_value_dir_get(key)) < members:
        if state.client is not client:
            raise RuntimeError(f"meeting {name!r}: the group was left while waiting")
        if abandoned is not None and abandoned.is_set():
            raise RuntimeError(f"meeting {name!r}: abandoned")
        if time.monotonic() > deadline:
            raise TimeoutError(f"meeting {name!r}: not every one of {members} processes came in {timeout_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, _MEET_LAST_POLL_S)
