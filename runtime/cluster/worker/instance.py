"""Where a worker runs: the name of its instance (host), as Google Cloud's maintenance notices name it.

The worker says it in its ``Hello``; the controller maps a notice about an instance to the workers on it. The
first of these that gives a name wins:

1. ``ELASTIC_INSTANCE`` (a name the cluster configures),
2. the metadata server's ``instance/name`` when ``ELASTIC_METADATA_HOST`` names one (a GCE or TPU VM),
3. ``SLURMD_NODENAME`` (a SLURM step), ``NODE_NAME`` (a Kubernetes pod, from the downward API's
   ``spec.nodeName``),
4. the host name (on Compute Engine, the instance's name).
"""

from __future__ import annotations

import logging
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from elastic_runtime.cluster.worker.settings import WorkerSettings

__all__ = ["instance_name", "metadata_instance_name"]

log = logging.getLogger(__name__)

_TIMEOUT_S = 2.0


def metadata_instance_name(host: str, timeout: float = _TIMEOUT_S) -> str:
    """The instance's name from the metadata server at ``host`` (``host:port``); "" when it does not answer."""
    url = f"http://{host}/computeMetadata/v1/instance/name"
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return str(response.read().decode().strip())
    except (OSError, urllib.error.URLError, ValueError, UnicodeDecodeError) as exc:
        log.warning("instance name: metadata server at %s did not answer (%s); trying the next source", host, exc)
        return ""


def instance_name(
    settings: WorkerSettings,
    environ: Mapping[str, str] = os.environ,
    *,
    ask_metadata: Callable[[str], str] = metadata_instance_name,
) -> str:
    """This worker's instance name (see the module's docstring for the order)."""
    if settings.instance:
        return settings.instance
    if settings.metadata_host:
        name = ask_metadata(settings.metadata_host)
        if name:
            return name
    for variable in ("SLURMD_NODENAME", "NODE_NAME"):
        if environ.get(variable):
            return environ[variable]
    return socket.gethostname()
