"""Shared test setup: 8 virtual CPU devices in every test process, and small helpers."""

from __future__ import annotations

import jax

# Before any test touches a device: the backend reads this once, when it starts.
jax.config.update("jax_num_cpu_devices", 8)


import pytest  # noqa: E402


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
