"""XLA's CPU collective timeout, raised before XLA reads its flags.

On CPU, XLA aborts the whole process (``F rendezvous.cc ... Termination timeout for 'all gather' ... of 40
seconds exceeded``) when a collective waits longer than ``--xla_cpu_collective_call_terminate_timeout_seconds``
(40 s by default): a fatal abort, not a ``JaxRuntimeError``, so nothing can recover from it. A loaded machine
reaches it (a peer device's thread descheduled), and so does a worker's step abandoned in a collective with a
dead peer while the group re-forms without it. Hangs are the runtime's to detect (heartbeats, ``--hang-timeout``),
so the runtime raises the limit to a day, unless the user set the flag. XLA reads ``XLA_FLAGS`` once, when the
first backend starts: importing this module (``runtime`` does, first) sets it, before any device is touched.
"""

from __future__ import annotations

import os

FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
SECONDS = 24 * 3600


def raise_cpu_collective_timeout(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Add the flag to ``XLA_FLAGS`` unless it is there; True if it was added."""
    flags = environ.get("XLA_FLAGS", "")
    if FLAG in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={SECONDS}".strip()
    return True


raise_cpu_collective_timeout()
