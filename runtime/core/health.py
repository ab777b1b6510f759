"""Device health: probe each device with a round trip through its memory, and watch for devices coming back.

A probe that raises means the device is gone. Extra checks (``DeviceHealth.checks``) can rule a device out
for reasons of their own, such as a site's hardware monitor or a fault injector in tests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

DeviceCheck = Callable[[int], bool]
"""Takes a device id; False means the device counts as unhealthy."""


class DeviceHealth:
    """Answers which devices are healthy now."""

    def __init__(self) -> None:
        self.checks: list[DeviceCheck] = []
        self.cordoned: frozenset[int] = frozenset()  # devices kept out on purpose (planned maintenance)

    def cordon(self, devices: tuple[int, ...]) -> None:
        self.cordoned = self.cordoned | set(devices)

    def uncordon(self, devices: tuple[int, ...]) -> None:
        self.cordoned = self.cordoned - set(devices)

    def probe(self, device: Any) -> bool:
        if device.id in self.cordoned:
            return False
        if not all(check(device.id) for check in self.checks):
            return False
        try:
            # A transfer, not a computation: a computation is compiled once per device, paid at every start,
            # and a lost device fails a transfer as it fails a step.
            echoed = int(np.asarray(jax.device_put(np.int32(1), device)))
        except jax.errors.JaxRuntimeError as exc:
            log.warning("device %s failed its health probe: %s", device.id, exc)
            return False
        return echoed == 1

    def healthy(self, devices: Sequence[Any] | None = None) -> list[Any]:
        """The healthy subset of ``devices`` (default: every device of the backend). Blocking."""
        return [d for d in (jax.devices() if devices is None else devices) if self.probe(d)]
