"""Fault injection for demos and tests: lose devices or slices at chosen steps, bring them back later, or make a
device compute wrong.

A lost device fails the step that runs on it with the exception a real runtime raises, a
``jax.errors.JaxRuntimeError`` whose status is one Pathways reads as a lost slice (DATA_LOSS by default),
and it fails health probes until it is repaired. The fault surfaces after the step's computation, as it
does when a real device dies mid-step and ``block_until_ready`` reports it; the step's result is discarded.

Silent data corruption raises nothing: a bit of one device's copy of a replicated leaf is flipped in the state
the next step reads, once (a transient flip) or before every step from then on (a device that computes wrong),
the way a bad processor or memory would leave it. Only the state's fingerprint can tell.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from jax.errors import JaxRuntimeError

from elastic_runtime.core.runtime import Runtime
from elastic_runtime.faults.corruption import flip_a_bit
from elastic_runtime.faults.grammar import Fault, parse_faults

R = TypeVar("R", bound=Runtime)


@dataclass(frozen=True)
class DeviceFault:
    """Devices ``devices`` die before step ``at_step`` runs; that step fails with ``status``."""

    at_step: int
    devices: tuple[int, ...]
    status: str = "DATA_LOSS"


@dataclass(frozen=True)
class Corruption:
    """Device ``device``'s copy of the state is corrupted in what step ``at_step + 1`` reads: once, or, with
    ``persistent``, before every step from then on while the device is in the mesh."""

    at_step: int
    device: int
    persistent: bool = False


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
        # device id -> (status it fails with, first step that fails on it). A step already running when a
        # fault is applied for a later step (the executor keeps one in flight) still completes.
        self._dead: dict[int, tuple[str, int]] = {}
        self._corruptions: list[Corruption] = []
        self.corrupted: list[tuple[int, int]] = []  # (step that read it, device) of every corruption done

    def attach(self, runtime: R) -> R:
        """Plug into ``runtime`` through the hooks it has for every user: a dead device fails its health
        check (``runtime.health.checks``) and the steps that ran on it (``runtime.executor.core.step_checks``);
        scheduled faults and repairs apply at step boundaries. Returns ``runtime``."""
        runtime.health.checks.append(lambda device_id: not self.is_dead(device_id))
        runtime.executor.core.step_checks.append(self.check)
        runtime.executor.core.input_faults.append(self.corrupt_input)
        runtime.at_step_boundary(self.advance)
        return runtime

    def corrupt(self, at_step: int, device: int, *, persistent: bool = False) -> FaultInjector:
        """Flip a bit of ``device``'s copy of a replicated leaf in the state step ``at_step + 1`` reads; with
        ``persistent``, in what every later step reads too (a device that computes wrong)."""
        with self._lock:
            self._corruptions.append(Corruption(at_step, device, persistent))
        return self

    def corrupt_input(self, step: int, state: Any) -> Any:
        """The executor's input fault (``StepExecutor.core.input_faults``): ``state`` as step ``step`` reads it."""
        with self._lock:
            due = [c for c in self._corruptions if c.at_step + 1 == step or (c.persistent and c.at_step < step)]
            self._corruptions = [c for c in self._corruptions if c.persistent or c.at_step + 1 != step]
        for corruption in due:
            state, hit = flip_a_bit(state, corruption.device)
            if hit:
                self.corrupted.append((step, corruption.device))
        return state

    def lose_devices(self, at_step: int, devices: Iterable[int], status: str = "DATA_LOSS") -> FaultInjector:
        """Kill ``devices`` before step ``at_step``: it fails with a ``JaxRuntimeError`` of ``status``."""
        with self._lock:
            self._pending.append(DeviceFault(at_step, tuple(devices), status))
        return self

    def lose_slice(self, at_step: int, slice_index: int, slice_size: int) -> FaultInjector:
        """Kill slice ``slice_index`` (devices ``slice_index * slice_size`` on, ``slice_size`` of them) before
        step ``at_step``."""
        first = slice_index * slice_size
        return self.lose_devices(at_step, range(first, first + slice_size))

    def repair(self, at_step: int, devices: Iterable[int]) -> FaultInjector:
        """Bring ``devices`` back before step ``at_step``: healthy again, the scale-up watcher offers them."""
        with self._lock:
            self._pending.append(DeviceRepair(at_step, tuple(devices)))
        return self

    def kill_now(self, devices: Iterable[int], status: str = "DATA_LOSS", from_step: int = 0) -> None:
        """Kill ``devices`` now: steps from ``from_step`` on (0: every step checked from now) fail on them."""
        with self._lock:
            self._dead.update(dict.fromkeys(devices, (status, from_step)))

    def repair_now(self, devices: Iterable[int]) -> None:
        """Bring ``devices`` back now."""
        with self._lock:
            for device in devices:
                self._dead.pop(device, None)

    @property
    def dead(self) -> frozenset[int]:
        """The devices dead now."""
        with self._lock:
            return frozenset(self._dead)

    def is_dead(self, device_id: int) -> bool:
        """Whether device ``device_id`` is dead now (its health check fails)."""
        with self._lock:
            return device_id in self._dead

    def advance(self, step: int) -> None:
        """Apply every fault and repair scheduled at or before ``step`` (the step about to run)."""
        with self._lock:
            due = [item for item in self._pending if item.at_step <= step]
            self._pending = [item for item in self._pending if item.at_step > step]
            for item in sorted(due, key=lambda i: i.at_step):
                if isinstance(item, DeviceFault):
                    self._dead.update(dict.fromkeys(item.devices, (item.status, item.at_step)))
                else:
                    for device in item.devices:
                        self._dead.pop(device, None)

    def check(self, step: int, device_ids: Iterable[int]) -> None:
        """Raise the error a real runtime raises if step ``step`` ran on a dead device."""
        with self._lock:
            hit = sorted(d for d in device_ids if d in self._dead and self._dead[d][1] <= step)
            status = self._dead[hit[0]][0] if hit else ""
        if hit:
            raise JaxRuntimeError(f"{status}: device(s) {hit} stopped responding during step {step} (injected)")


# --- schedules: the same faults at the same points, for reproducible demos and benchmarks ----------------


class FaultSchedule:
    """A list of faults and repairs, by step or by time, applied to a :class:`FaultInjector`.

    Text form: the device actions of the fault grammar (``elastic_runtime.faults.grammar``), comma-separated
    ``ACTION:TARGET@WHEN``: ACTION is lose-slice, lose-device, repair-slice or repair-device; TARGET an index
    or ``random`` (lose: a slice or device not yet lost; repair: the oldest random loss); WHEN a step
    (``120``) or seconds of training (``90s``). Example: ``lose-slice:3@100,repair-slice:3@200``.
    ``every(period_s, repair_after_s=...)`` builds the periodic schedule of the goodput benchmark.
    """

    def __init__(self, actions: Iterable[Fault], *, slice_size: int, devices: int, seed: int = 0) -> None:
        self.pending = list(actions)
        self.slice_size = slice_size
        self.devices = devices
        self._random = random.Random(seed)
        self._started: float | None = None
        self._random_losses: list[tuple[int, ...]] = []  # a random repair brings back the oldest random loss

    @classmethod
    def parse(cls, text: str, *, slice_size: int, devices: int, seed: int = 0) -> FaultSchedule:
        """Parse the device actions of the fault grammar (``elastic_runtime.faults.grammar``). Raises ValueError
        naming the item that is wrong."""
        return cls(parse_faults(text, kinds=("device",)), slice_size=slice_size, devices=devices, seed=seed)

    @classmethod
    def every(
        cls, period_s: float, *, repair_after_s: float, slice_size: int, devices: int, seed: int = 0
    ) -> FaultSchedule:
        """Lose a random slice every ``period_s`` seconds of training and repair it ``repair_after_s`` later."""
        if not 0 < repair_after_s < period_s:
            raise ValueError(f"repair_after_s={repair_after_s} must be between 0 and period_s={period_s}")
        actions = [
            Fault("lose-slice", -1, seconds=period_s, repeat_s=period_s),
            Fault("repair-slice", -1, seconds=period_s + repair_after_s, repeat_s=period_s),
        ]
        return cls(actions, slice_size=slice_size, devices=devices, seed=seed)

    def __str__(self) -> str:
        return ", ".join(str(action) for action in self.pending) or "none"

    def hook(
        self, injector: FaultInjector, clock: Callable[[], float] = time.monotonic, start: float | None = None
    ) -> Callable[[int], None]:
        """A step-boundary hook that applies what is due before each step.

        Times count from ``start`` (on ``clock``), by default from the hook's first call.
        """

        def apply(step: int) -> None:
            now = clock()
            if self._started is None:
                self._started = now if start is None else start
            elapsed = now - self._started
            for action in [a for a in self.pending if a.due(step, elapsed)]:
                self.pending.remove(action)
                self._apply(action, injector, step)
                if action.repeat_s is not None and action.seconds is not None:
                    self.pending.append(replace(action, seconds=action.seconds + action.repeat_s))

        return apply

    def _apply(self, action: Fault, injector: FaultInjector, step: int) -> None:
        size = self.slice_size if action.action.endswith("slice") else 1
        if action.target >= 0:
            devices = tuple(range(action.target * size, (action.target + 1) * size))
        elif action.action.startswith("lose"):
            groups = [tuple(range(i, i + size)) for i in range(0, self.devices, size)]
            alive = [g for g in groups if not set(g) & injector.dead]
            if not alive:
                return
            devices = self._random.choice(alive)
            self._random_losses.append(devices)
        elif self._random_losses:
            devices = self._random_losses.pop(0)
        else:
            return
        if action.action.startswith("lose"):
            injector.kill_now(devices, from_step=step)  # the step about to run, not one already running
        else:
            injector.repair_now(devices)
