"""Shared test setup: 8 virtual CPU devices in every test process, and small helpers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax

# Before any test touches a device: the backend reads this once, when it starts.
jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def compiles() -> Iterator[list[float]]:
    """The duration of every XLA compile from now on (jit calls and ahead-of-time compiles alike)."""
    seen: list[float] = []

    def listen(event: str, seconds: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.fixture
def copied_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    """RAM snapshots copied to host memory, as on an accelerator: on these CPU devices the executor commits the
    state itself (``elastic_runtime.core.snapshot.in_host_memory``), and the copies' own paths would go untested."""
    monkeypatch.setattr("elastic_runtime.core.executor.in_host_memory", lambda mesh: False)
