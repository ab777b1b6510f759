"""The google-cloud-storage detail elastic-runtime depends on: a client's authorized HTTP session.

``elastic_runtime.storage.gcs`` drives a resumable upload itself (it asks the server how much it holds after a failed
piece), which needs the ``requests`` session the client authorizes. google-cloud-storage exposes it only as
the private ``Client._http`` (from ``google.cloud.client.Client``); no public accessor exists in 3.x.
"""

from __future__ import annotations

from typing import Any

from elastic_runtime.compat.errors import incompatible

SUPPORTED = "3.x"


def authorized_session(client: Any) -> Any:
    """``client``'s authorized HTTP session (``google.cloud.storage.Client._http``), with ``put`` and ``get``.

    Raises:
        IncompatibleVersion: the client has no such session any more.
    """
    where = "google.cloud.storage.Client._http"
    try:
        http = client._http
    except AttributeError as exc:
        raise incompatible("google-cloud-storage", where, "is missing", SUPPORTED) from exc
    if not callable(getattr(http, "put", None)):
        raise incompatible("google-cloud-storage", where, f"is a {type(http).__name__} with no put()", SUPPORTED)
    return http
