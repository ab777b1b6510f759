"""Fault injection for demos and tests: lose devices or slices at chosen steps, bring them back later.

A lost device fails the step that runs on it with the exception a real runtime raises, a
``jax.errors.JaxRuntimeError`` whose status is one Pathways reads as a lost slice (DATA_LOSS by default),
and it fails health probes until it is repaired. The fault surfaces after the step's computation, as it
does when a real device dies mid-step and ``block_until_ready`` reports it; the step's result is discarded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from jax.errors import JaxRuntimeError


@dataclass(frozen=True)
class DeviceFault:
    """Devices ``devices`` die before step ``at_step`` runs; that step fails with ``status``."""

    at_step: int
    devices: tuple[int, ...]
    status: str = "DATA_LOSS"


@dataclass(frozen=True)
class DeviceRepair:
    """Devices ``devices`` are healthy again from step ``at_step`` on."""

    at_step: int
    devices: tuple[int, ...]


class FaultInjector:
    """A schedule of device faults and repairs, applied at step boundaries. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[DeviceFault | DeviceRepair] = []
        self._dead: dict[int, str] = {}  # device id -> status it fails with

    def lose_devices(self, at_step: int, devices: Iterable[int], status: str = "DATA_LOSS") -> FaultInjector:
        with self._lock:
            self._pending.append(DeviceFault(at_step, tuple(devices), status))
        return self

    def lose_slice(self, at_step: int, slice_index: int, slice_size: int) -> FaultInjector:
        first = slice_index * slice_size
        return self.lose_devices(at_step, range(first, first + slice_size))

    def repair(self, at_step: int, devices: Iterable[int]) -> FaultInjector:
        with self._lock:
            self._pending.append(DeviceRepair(at_step, tuple(devices)))
        return self

    def kill_now(self, devices: Iterable[int], status: str = "DATA_LOSS") -> None:
        with self._lock:
            self._dead.update(dict.fromkeys(devices, status))

    def repair_now(self, devices: Iterable[int]) -> None:
        with self._lock:
            for device in devices:
                self._dead.pop(device, None)

    @property
    def dead(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._dead)

    def is_dead(self, device_id: int) -> bool:
        with self._lock:
            return device_id in self._dead

    def advance(self, step: int) -> None:
        """Apply every fault and repair scheduled at or before ``step`` (the step about to run)."""
        with self._lock:
            due = [item for item in self._pending if item.at_step <= step]
            self._pending = [item for item in self._pending if item.at_step > step]
            for item in sorted(due, key=lambda i: i.at_step):
                if isinstance(item, DeviceFault):
                    self._dead.update(dict.fromkeys(item.devices, item.status))
                else:
                    for device in item.devices:
                        self._dead.pop(device, None)

    def check(self, step: int, device_ids: Iterable[int]) -> None:
        """Raise the error a real runtime raises if step ``step`` ran on a dead device."""
        with self._lock:
            hit = sorted(d for d in device_ids if d in self._dead)
            status = self._dead[hit[0]] if hit else ""
        if hit:
            raise JaxRuntimeError(f"{status}: device(s) {hit} stopped responding during step {step} (injected)")
