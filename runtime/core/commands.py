"""The requests handlers send the executor through ``ctx``: queued, and carried out in order at the next
step boundary (``StepExecutor.send``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jax.sharding import Mesh

__all__ = ["Abort", "Command", "Pause", "Remesh", "Restore", "Resume", "TransformState"]


@dataclass(frozen=True)
class Pause:
    reason: str


@dataclass(frozen=True)
class Resume:
    reason: str


@dataclass(frozen=True)
class Remesh:
    mesh: Mesh
    reason: str


@dataclass(frozen=True)
class Restore:
    source: str


@dataclass(frozen=True)
class Abort:
    reason: str


@dataclass(frozen=True)
class TransformState:
    fn: Callable[[Any], Any]
    reason: str


Command = Pause | Resume | Remesh | Restore | Abort | TransformState
