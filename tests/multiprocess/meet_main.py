"""One process of ``test_meet.py``: two processes of a ``jax.distributed`` group, process 1 late by host work
(``LATE_S``) before a collective whose timeout is shorter, meeting first unless told not to; then process 0
waits at meetings nobody else comes to: until its timeout, until the wait is abandoned, until it leaves the
group."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import elastic_runtime  # noqa: F401  # sets the collective timeout from ELASTIC_COLLECTIVE_TIMEOUT_S, before JAX starts

LATE_S = 4.0

process_id, coordinator, meeting = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "meet"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from elastic_runtime.cluster.worker.group import leave_group, meet  # noqa: E402
from elastic_runtime.compat.jax import distributed_state  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator, num_processes=2, process_id=process_id)
mesh = Mesh(np.array(jax.devices()), ("x",))
ones = jax.make_array_from_callback((2,), NamedSharding(mesh, P("x")), lambda _: np.ones((1,), np.float32))
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P())).lower(ones).compile()
# Compiled by both, then run once together: on a loaded machine one compile may end seconds after the other,
# longer than the 2 s collective timeout (a barrier of JAX's own, not the meeting under test).
distributed_state().client.wait_at_barrier("compiled", 120_000)
total(ones).block_until_ready()

if process_id == 1:
    time.sleep(LATE_S)  # a long read of this process's shards, say
if meeting:
    meet("collective", timeout_s=60.0)
try:
    print("sum", float(total(ones)), flush=True)
except Exception as exc:
    print("collective failed:", type(exc).__name__, str(exc)[:200], flush=True)
    os._exit(3)

if process_id == 0:
    started = time.monotonic()
    try:
        meet("alone", timeout_s=0.5)
    except TimeoutError as exc:
        print("timed out after", round(time.monotonic() - started, 2), exc, flush=True)

    def wait_in_thread(name: str, end: Callable[[], None], abandoned: threading.Event | None = None) -> str:
        """Wait at ``name`` in a thread, end the wait with ``end()``: how the thread's wait ended."""
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                meet(name, timeout_s=60.0, abandoned=abandoned)
            except RuntimeError as exc:
                failed.append(exc)

        waiting = threading.Thread(target=wait)
        waiting.start()
        time.sleep(0.5)
        end()
        waiting.join(timeout=10.0)
        return str(failed[0]) if failed else "still waiting" if waiting.is_alive() else "returned"

    abandoned = threading.Event()
    print("abandoned:", wait_in_thread("abandoned", abandoned.set, abandoned), flush=True)
    print("left:", wait_in_thread("left", leave_group), flush=True)
else:
    leave_group()
os._exit(0)
