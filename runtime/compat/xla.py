"""XLA's CPU collective timeout, raised before XLA reads its flags.

On CPU, XLA aborts the whole process (``F rendezvous.cc ... Termination timeout for 'all gather' ... of 40
seconds exceeded``) when a collective waits longer than ``--xla_cpu_collective_call_terminate_timeout_seconds``
(40 s by default): a fatal abort, not a ``JaxRuntimeError``, so nothing can recover from it. A loaded machine
reaches it (a peer device's thread descheduled for long), and so does a worker's step abandoned in a collective
with a dead peer while the group re-forms without it. So the runtime raises the limit to 5 minutes, unless the
user set the flag. Not further: XLA's CPU collectives can also deadlock for good (a step whose scanned loop holds
collectives, beside another collective that does not depend on the loop: devices took them in different orders;
docs/maxtext.md, "The hang, found"), and in one process nothing else would end that hang; under ``launch``
the controller's ``--hang-timeout`` replaces such a worker first.
XLA reads ``XLA_FLAGS`` once, when the first backend starts: importing this module (``runtime`` does, first)
sets it, before any device is touched.
"""

from __future__ import annotations

import os

FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
SECONDS = 300


def raise_cpu_collective_timeout(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Add the flag to ``XLA_FLAGS`` unless it is there; True if it was added."""
    flags = environ.get("XLA_FLAGS", "")
    if FLAG in flags:
        return False
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={SECONDS}".strip()
    return True


raise_cpu_collective_timeout()
