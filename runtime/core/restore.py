"""One restore routine: a given step read from the first of its sources that verifies (:func:`restore_step`),
and the newest step any source holds that verifies (:func:`restore_newest`, built on it). Shared by
``ctx.restore("latest")``, the checkpointer, every tier's ``latest`` and the multi-process worker's read of its
own shards (its RAM replica, its replica files, the durable tier)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from elastic_runtime.core.errors import CheckpointInvalid, ConfigError, SnapshotUnavailable, StorageError
from elastic_runtime.core.snapshot import HostSnapshot

__all__ = ["CorruptionListener", "RestoreSource", "refuse_earlier_checkpoints", "restore_newest", "restore_step"]

log = logging.getLogger(__name__)

PyTree = Any
CorruptionListener = Callable[[str, int, CheckpointInvalid], None]  # (source name, step, what failed)


class RestoreSource(Protocol):
    """Somewhere a restore can read a snapshot from: the RAM tier, ``/dev/shm``, disk, GCS."""

    name: str
    corruption_listeners: list[CorruptionListener]

    def steps(self, *, timeout: float) -> list[int]:
        """The committed steps it holds, newest first. Raises StorageError when it cannot tell."""
        ...

    def restore(self, step: int, like: PyTree = None, *, timeout: float) -> HostSnapshot:
        """Read and verify ``step``. Raises CheckpointInvalid, SnapshotUnavailable or StorageError."""
        ...


def restore_newest(
    sources: Sequence[RestoreSource], like: PyTree = None, *, timeout: float
) -> tuple[RestoreSource, HostSnapshot]:
    """The newest step that verifies in any of ``sources`` (given fastest first), from the fastest holder.

    A checkpoint that fails verification is reported to its source's ``corruption_listeners`` and the next
    candidate is tried: the same step in a slower source, then older steps.

    Raises:
        SnapshotUnavailable: no source holds a snapshot that verifies; the message says what each one had.
    """
    holders: dict[int, list[RestoreSource]] = {}
    problems: list[str] = []
    for source in sources:
        try:
            steps = source.steps(timeout=timeout)
        except (StorageError, SnapshotUnavailable) as exc:
            log.warning("restore: cannot list %s: %s", source.name, exc)
            problems.append(f"{source.name}: cannot list: {exc}")
            continue
        for step in steps:
            holders.setdefault(step, []).append(source)
    for step in sorted(holders, reverse=True):
        try:
            return restore_step(holders[step], step, like, timeout=timeout)
        except (CheckpointInvalid, SnapshotUnavailable) as exc:
            problems.append(str(exc))
    names = ", ".join(s.name for s in sources) or "no source"
    raise SnapshotUnavailable(f"nothing restorable in {names} ({'; '.join(problems) or 'none committed'})")


def restore_step(
    sources: Sequence[RestoreSource], step: int, like: PyTree = None, *, timeout: float
) -> tuple[RestoreSource, HostSnapshot]:
    """Step ``step`` from the first of ``sources`` (given fastest first, each holding it) that verifies.

    A copy that fails verification is reported to its source's ``corruption_listeners``, and the next source
    is tried.

    Raises:
        CheckpointInvalid: every source's copy failed verification (the last one's error, naming the rest).
        SnapshotUnavailable: no source could read the step at all (missing, unreachable), none was damaged.
    """
    problems: list[str] = []
    invalid: CheckpointInvalid | None = None
    for source in sources:
        try:
            return source, source.restore(step, like, timeout=timeout)
        except CheckpointInvalid as exc:
            problems.append(f"{source.name} step {step}: {exc}")
            invalid = exc
            for listener in source.corruption_listeners:
                listener(source.name, step, exc)
        except (SnapshotUnavailable, StorageError) as exc:
            problems.append(f"{source.name} step {step}: {exc}")
    if invalid is not None:
        raise CheckpointInvalid("; ".join(problems), path=invalid.path, reason=invalid.reason) from invalid
    raise SnapshotUnavailable("; ".join(problems) or f"step {step}: no source holds it")


def refuse_earlier_checkpoints(sources: Sequence[RestoreSource], timeout: float) -> None:
    """Raises ConfigError when a source already holds checkpoints: an earlier run's, which a new run (one
    that does not resume) would mix with its own, in retention and in "latest" restores."""
    held = {}
    for source in sources:
        try:
            steps = source.steps(timeout=timeout)
        except (StorageError, SnapshotUnavailable) as exc:
            log.warning("cannot tell whether %s holds checkpoints: %s", source.name, exc)
            continue
        if steps:
            held[source.name] = max(steps)
    if held:
        found = ", ".join(f"{name} up to step {step}" for name, step in held.items())
        raise ConfigError(
            f"the checkpoint tiers already hold an earlier run's checkpoints ({found}): run(steps, "
            "resume=True) continues from the newest; a new run_dir (or checkpoint_dir, ram_dir, gcs_uri) "
            "starts afresh"
        )
