"""Retry policy for recovery: how long to wait for enough healthy devices, built from tenacity parts."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from elastic_runtime.core.errors import MeshUnavailable

T = TypeVar("T")


async def wait_for_mesh(attempt: Callable[[], Awaitable[T]], *, wait_s: float, poll_s: float, sleep: Any = None) -> T:
    """Call ``attempt`` until it stops raising MeshUnavailable or ``wait_s`` has passed.

    Raises:
        MeshUnavailable: the last attempt's error, once the wait is over.
    """
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(MeshUnavailable),
        stop=stop_after_delay(wait_s),
        wait=wait_fixed(poll_s),
        reraise=True,
        **({} if sleep is None else {"sleep": sleep}),
    )
    async for trial in retrying:
        with trial:
            return await attempt()
    raise AssertionError("unreachable: tenacity either returns or re-raises")
