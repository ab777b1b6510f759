"""Stand-ins for the lost seats of a generation given up before it formed, run as a process of their own:
``python -m elastic_runtime.cluster.controller.standin COORDINATOR SEAT [SEAT ...]``.

A group's members wait in JAX's start (the coordination client's ``connect``) until every seat is taken. When a
member is lost before it took its seat, the controller forms the next generation without it, and the members
go on to that one, but their connect to the given-up generation can neither be cancelled nor left to fail (a
client that fails to connect terminates its process: ``runtime/cluster/worker/group.py``). Each stand-in takes
a lost seat, so that every connect returns; then every client, the stand-ins' and the members', leaves. A
process of its own, because a client whose service fails terminates the process that holds it: here, only
this one, never the controller.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from elastic_runtime.compat import jax as jax_compat

__all__ = ["command", "main"]

log = logging.getLogger(__name__)

# As long as a member waits in JAX's start (``WorkerSettings.jax_init_s``'s default): past it, nobody waits.
INIT_TIMEOUT_S = 60


def command(coordinator: str, seats: tuple[int, ...]) -> list[str]:
    """The command line that fills ``seats`` of the generation whose service is at ``coordinator``."""
    return [sys.executable, "-m", __name__, coordinator, *map(str, seats)]


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin %(levelname)s %(message)s")
    coordinator, seats = argv[0], [int(seat) for seat in argv[1:]]
    clients = [
        jax_compat.distributed_runtime_client(
            coordinator,
            seat,
            init_timeout=INIT_TIMEOUT_S,
            use_compression=True,
            heartbeat_timeout=30,
            shutdown_timeout=2,
        )
        for seat in seats
    ]
    # One thread per seat: each connect returns only once every seat is taken, the other stand-ins' too.
    threads = [threading.Thread(target=client.connect, daemon=True) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client in clients:
        _leave(client)
    log.info("seats %s of the given-up generation at %s filled and left", seats, coordinator)
    return 0


def _leave(client: Any) -> None:
    try:
        client.shutdown()
    except Exception as exc:  # the members may have left first; the group never formed
        log.warning("leaving: %s: %s", type(exc).__name__, exc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
