"""Joining and leaving a generation's ``jax.distributed`` group, whose coordination service the controller hosts."""

from __future__ import annotations

import logging

from runtime.cluster.protocol import Form
from runtime.cluster.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def join_group(form: Form, settings: WorkerSettings) -> None:
    """Connect this process to the group's coordination service, which the controller hosts.

    ``jax.distributed.initialize`` would start the service inside process 0; measured here, when process 0
    is then killed every survivor's coordination client polls an error and terminates its process (and a
    Python error callback cannot stand in: jaxlib 0.10.2 aborts casting its status). With the service in
    the never-restarted controller, any worker, process 0 included, can die without taking the others down.
    This uses the same private entry points ``initialize`` uses, through :mod:`runtime.compat.jax`.
    """
    from runtime.compat import jax as jax_compat

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
    client.connect()
    state.client = client
    state.coordinator_address = form.coordinator
    state.process_id = form.process_id
    state.num_processes = form.num_processes


def leave_group() -> None:
    """Disconnect from the old group's service (still up in the controller, so this returns at once)."""
    from runtime.compat import jax as jax_compat

    state = jax_compat.distributed_state()
    client, state.client = state.client, None
    if client is not None:
        try:
            client.shutdown()
        except Exception as exc:  # the old group is broken by design here; its shutdown may complain
            log.warning("leaving the old group: %s: %s", type(exc).__name__, exc)
