"""Progress a person can follow: a line about the steps now and then, and one for every failure and recovery.

The lines about steps come from a timer reading the executor's newest committed step, not from a handler of
every ``StepCompleted``: the steps pay nothing for them. Failures, mesh changes, recoveries and the end are
rare, and each gets its line as its event is published. Everything goes to stderr (stdout stays the script's).
No JAX here: the controller of a multi-process run prints the group's lines with the same words.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Protocol

import anyio

from elastic_runtime.core.bus import Subscription
from elastic_runtime.core.events import (
    CheckpointBehind,
    ConfigOverridden,
    CorruptionHealed,
    Failure,
    HandlerFailed,
    MeshChanged,
    NoticeSourceFailed,
    NoticeSourceReady,
    RecoveryCompleted,
    RunFinished,
    RunStarted,
    SilentCorruption,
    StateRestored,
    StepCompleted,
)

__all__ = ["ProgressLines", "describe_event", "describe_mesh", "describe_metrics", "say"]

PREFIX = "elastic-runtime:"


class Stepping(Protocol):
    """What the progress lines read: the newest committed step and how it trained (core/step_core.py)."""

    @property
    def step(self) -> int: ...

    mesh_shape: dict[str, int]  # of the newest committed step
    metrics: dict[str, float]  # of the newest committed step
    productive_s: float  # the committed steps' computation, in all


def say(text: str, out: IO[str] | None = None) -> None:
    """One progress line, on stderr unless ``out`` is given."""
    print(f"{PREFIX} {text}", file=out or sys.stderr, flush=True)


def describe_mesh(shape: dict[str, int]) -> str:
    """``data=4xmodel=2 (8 devices)``; axes of size 1 are left out (MaxText's mesh names a dozen)."""
    devices = 1
    for size in shape.values():
        devices *= size
    sized = [f"{axis}={size}" for axis, size in shape.items() if size > 1] or [f"{next(iter(shape), 'data')}=1"]
    return "x".join(sized) + f" ({devices} devices)"


def describe_metrics(metrics: dict[str, float], *, limit: int = 6) -> str:
    """The loss first, then the step's other metrics, each as ``name value`` (at most ``limit`` of them)."""
    names = sorted(metrics, key=lambda name: (name.rsplit("/", 1)[-1] != "loss", name))[:limit]
    return "  ".join(f"{name.rsplit('/', 1)[-1]} {metrics[name]:.5g}" for name in names)


def describe_event(event: Any) -> str | None:
    """One line for a rare event a person wants to see; None for the others."""
    match event:
        case RecoveryCompleted():
            return (
                f"recovered: step {event.step} committed {event.recovery_s:.3f} s after the failure, "
                f"{event.lost_steps} step(s) lost"
            )
        case StateRestored():
            why = f" ({event.lost_steps} step(s) lost: {event.reason})" if event.reason else ""
            return f"restored step {event.step} from {event.restored_from} in {event.seconds:.3f} s{why}"
        case MeshChanged():
            return f"mesh {describe_mesh(event.old_shape)} -> {describe_mesh(event.new_shape)}: {event.reason}"
        case CorruptionHealed():
            how = (
                f"devices {list(event.evicted)} evicted" if event.evicted else "replayed from the newest verified state"
            )
            return f"silent data corruption healed at step {event.step} ({event.kind}): {how}"
        case CheckpointBehind():
            return (
                f"{event.tier} checkpoints behind their cadence: step {event.step} waits for the write of step "
                f"{event.writing} ({event.behind_steps} steps past the newest commit)"
            )
        case NoticeSourceFailed():
            return (
                f"maintenance notices from {event.source} ({event.address}) unavailable: {event.reason}; "
                f"retrying every {event.retry_s:g} s at most (no maintenance protection meanwhile)"
            )
        case NoticeSourceReady():
            return f"maintenance notices from {event.source} ({event.address}) ready"
        case ConfigOverridden():
            return f"the script's {event.setting}={event.value} does not apply under launch: {event.flag}"
        case SilentCorruption():
            if not event.persistent:
                verdict = "replaying the step to tell a flipped bit from a device that computes wrong"
            elif event.workers:
                verdict = f"it came back: workers {list(event.workers)} are replaced"
            else:
                verdict = f"it came back: devices {list(event.suspects)} are evicted"
            return f"silent data corruption after step {event.step}: {event.message}; {verdict}"
        case HandlerFailed():
            return f"a handler failed ({event.handler} on {event.event_type}): {event.error_type}: {event.message}"
        case Failure():
            what = f"{event.error_type}: {event.message}" if event.error_type else event.message
            return f"{type(event).__name__} at step {event.step}" + (f": {what}" if what else "")
    return None


class ProgressLines:
    """A runtime component: prints the run's progress to ``out`` (see the module's docstring).

    Args:
        stepping: the executor's step core, read every ``every_s``.
        every_s: seconds between two lines about steps.
        out: where the lines go (stderr by default).
    """

    def __init__(self, stepping: Stepping, *, every_s: float, out: IO[str] | None = None) -> None:
        self.stepping = stepping
        self.every_s = every_s
        self.out = out
        self.target = 0
        self.started = 0.0
        self._shown = -1  # the step of the newest line about steps
        self._shown_at = 0.0
        self._first: Subscription[StepCompleted] | None = None

    def print(self, text: str) -> None:
        say(text, self.out)

    async def run(self, ctx: Any) -> None:
        ctx.subscribe(Failure, self._on_event, priority=-(10**6), timeout=None)
        for kind in (MeshChanged, StateRestored, RecoveryCompleted, RunStarted, RunFinished):
            ctx.subscribe(kind, self._on_event, priority=-(10**6), timeout=None)
        self._first = ctx.subscribe(StepCompleted, self._first_step, priority=-(10**6), timeout=None)
        while True:
            await anyio.sleep(self.every_s)
            self.steps()

    async def _first_step(self, event: StepCompleted, ctx: Any) -> None:
        """The first step's line (its time includes the first compile), then no more work per step."""
        if self._first is not None:
            ctx.unsubscribe(self._first)
            self._first = None
            self.steps()

    async def _on_event(self, event: Any, ctx: Any) -> None:
        if isinstance(event, RunStarted):
            self.target, self.started = event.target_steps, time.monotonic()
            self.print(f"training to step {event.target_steps} on mesh {describe_mesh(event.mesh_shape)}")
            return
        if isinstance(event, RunFinished):
            self.steps()
            end = "finished" if event.ok else f"ended: {event.reason}"
            self.print(f"{end} at step {event.step} after {time.monotonic() - self.started:.1f} s")
            return
        line = describe_event(event)
        if line is not None:
            self.print(line)

    def steps(self) -> None:
        """A line about the steps, if any was committed since the last one."""
        s = self.stepping
        step, now = s.step, time.monotonic()
        if step <= self._shown or step <= 0 or not s.mesh_shape:
            return
        since = now - (self._shown_at or self.started)
        per_step = since / (step - max(self._shown, 0)) * 1000
        self._shown, self._shown_at = step, now
        wall = now - self.started
        goodput = f"  goodput {100 * s.productive_s / wall:.1f}%" if wall > 0 else ""
        target = f"/{self.target}" if self.target else ""
        self.print(
            f"step {step}{target}  {describe_metrics(s.metrics)}  {per_step:.1f} ms/step  "
            f"mesh {describe_mesh(s.mesh_shape)}{goodput}"
        )
