"""XLA's CPU collective timeouts, set before XLA reads its flags.

Two limits, two opposite reasons:

- ``--xla_cpu_collective_call_terminate_timeout_seconds`` (40 s by default): past it XLA aborts the whole
  process (``F rendezvous.cc ... Termination timeout for 'all gather' ... of 40 seconds exceeded``), a fatal
  abort, not a ``JaxRuntimeError``, so nothing can recover from it. A loaded machine reaches it (a peer device's
  thread descheduled for long). So the runtime raises it to 5 minutes, unless the user set the flag. Not
  further: XLA's CPU collectives can also deadlock for good (a step whose scanned loop holds collectives, beside
  another collective that does not depend on the loop: devices took them in different orders; docs/maxtext.md,
  "The hang, found"), and in one process nothing else would end that hang; under ``launch`` the controller's
  ``--hang-timeout`` replaces such a worker first.
- ``--xla_cpu_collective_timeout_seconds`` (30 minutes by default): how long one gloo operation waits for its
  peers before it fails with a ``JaxRuntimeError``. A worker's step abandoned in a collective when a peer died
  (``runtime/cluster/worker/stepping.py``) waits that long, and until it ends the old group's backend stays
  alive in the survivor, its gloo thread polling without end: after each loss a survivor carried one more, and
  steps slowed by half (``docs/benchmarks.md``, "Step time after a loss"; the worker's garbage collections after
  a re-forming usually end it sooner, ``runtime/cluster/worker/forming.py``). So a worker started by a
  controller gets the controller's limit (``ELASTIC_COLLECTIVE_TIMEOUT_S``, from the hang timeout:
  :meth:`elastic_runtime.cluster.config.LaunchConfig.collective_timeout_s`), unless the user set the flag.

XLA reads ``XLA_FLAGS`` once, when the first backend starts: importing this module (``elastic_runtime`` does, first)
sets it, before any device is touched; a worker forked by the fork server, whose environment is replaced after
``elastic_runtime`` was imported, calls :func:`set_flags` again.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
SECONDS = 300
COLLECTIVE_FLAG = "--xla_cpu_collective_timeout_seconds"
ENV_COLLECTIVE_TIMEOUT = "ELASTIC_COLLECTIVE_TIMEOUT_S"


def add_flag(environ: MutableMapping[str, str], flag: str, seconds: int) -> None:
    """Add ``flag=seconds`` to ``XLA_FLAGS`` unless the flag is there (the user's own)."""
    flags = environ.get("XLA_FLAGS", "")
    if flag not in flags:
        environ["XLA_FLAGS"] = f"{flags} {flag}={seconds}".strip()


def set_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """The terminate timeout raised; the collective timeout lowered where a controller asks for it."""
    add_flag(environ, FLAG, SECONDS)
    if environ.get(ENV_COLLECTIVE_TIMEOUT):
        add_flag(environ, COLLECTIVE_FLAG, round(float(environ[ENV_COLLECTIVE_TIMEOUT])))


set_flags()
