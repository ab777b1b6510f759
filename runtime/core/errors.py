"""The runtime's exceptions: a flat set of small classes, each named after the state it reports."""

from __future__ import annotations


class ElasticRuntimeError(Exception):
    """Base of every error this library raises on purpose."""


class ConfigError(ElasticRuntimeError, ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


class JobUnsupported(ElasticRuntimeError):
    """The job cannot run in the mode it was started in (in multi-process mode: a state sharded across
    processes, which no single process could save or restore whole). Raised before the first step."""


class UnsupportedInMode(ElasticRuntimeError):
    """A handler asked ``ctx`` for something the mode it runs in cannot do (under ``launch``: ``remesh``,
    ``cordon``, a checkpoint without a durable tier); the message names the mode and why."""


class MeshUnavailable(ElasticRuntimeError):
    """The mesh policy cannot build a mesh from the devices that are healthy now."""


class StepError(ElasticRuntimeError):
    """The user's step raised an error that is not an infrastructure failure; the run stopped.

    ``step`` is the step that failed; the last committed state is untouched.
    """

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class RecoveryError(ElasticRuntimeError):
    """Recovery after a failure could not complete (no devices, no snapshot, a handler failed or timed out).

    ``last_committed_step`` is the newest step whose state is still held in the snapshot tiers.
    """

    def __init__(self, message: str, *, last_committed_step: int) -> None:
        super().__init__(message)
        self.last_committed_step = last_committed_step


class AuthenticationFailed(ElasticRuntimeError):
    """A connection to the controller's port did not prove the run's secret, or the controller did not prove it
    to a worker: the connection is closed before any message of it is read."""


class BusClosed(ElasticRuntimeError):
    """An event was published after the bus was closed."""


class EventLogError(ElasticRuntimeError):
    """An event log cannot be written or a line of it cannot be read back."""


class SnapshotUnavailable(ElasticRuntimeError):
    """No snapshot is held that a restore could use."""


class NoticeMalformed(ElasticRuntimeError, ValueError):
    """A maintenance notice (Pub/Sub message or metadata value) cannot be parsed; the message names the path."""


class CheckpointInvalid(ElasticRuntimeError):
    """A checkpoint failed verification: a missing, short or altered file, a manifest that does not parse, or a
    manifest naming a path outside its checkpoint. Such a checkpoint is never loaded.

    ``path`` locates the bad file (or the manifest), ``reason`` says what did not match.
    """

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


class StorageError(ElasticRuntimeError):
    """A checkpoint tier could not write, read, list or delete (disk full, I/O error, network, timeout).

    Raised from the underlying OS or Google Cloud error; the tier's committed checkpoints are untouched.
    """
