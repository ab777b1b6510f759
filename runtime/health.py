"""Device health: probe each device with a round trip through its memory, and watch for devices coming back.

A probe that raises means the device is gone. With a fault injector attached, injected dead devices fail
the probe too, exactly as real ones would.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from runtime.faults import FaultInjector

log = logging.getLogger(__name__)


class DeviceHealth:
    """Answers which devices are healthy now."""

    def __init__(self, injector: FaultInjector | None = None) -> None:
        self.injector = injector
        self.cordoned: frozenset[int] = frozenset()  # devices kept out on purpose (planned maintenance)

    def cordon(self, devices: tuple[int, ...]) -> None:
        self.cordoned = self.cordoned | set(devices)

    def uncordon(self, devices: tuple[int, ...]) -> None:
        self.cordoned = self.cordoned - set(devices)

    def probe(self, device: Any) -> bool:
        if device.id in self.cordoned:
            return False
        if self.injector is not None and self.injector.is_dead(device.id):
            return False
        try:
            # A transfer, not a computation: a computation is compiled once per device (0.4 s for 8 CPU
            # devices, paid at every start), and a lost device fails a transfer as it fails a step.
            echoed = int(np.asarray(jax.device_put(np.int32(1), device)))
        except jax.errors.JaxRuntimeError as exc:
            log.warning("device %s failed its health probe: %s", device.id, exc)
            return False
        return echoed == 1

    def healthy(self, devices: Sequence[Any] | None = None) -> list[Any]:
        """The healthy subset of ``devices`` (default: every device of the backend). Blocking."""
        return [d for d in (jax.devices() if devices is None else devices) if self.probe(d)]
