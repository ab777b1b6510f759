"""The one error of the compatibility layer, and the helpers that word it."""

from __future__ import annotations

from importlib import metadata


class IncompatibleVersion(RuntimeError):
    """Raised when an installed dependency lacks, or has changed, a private entry point elastic-runtime uses."""


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (``"not installed"`` when pip does not know it)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def incompatible(distribution: str, entry_point: str, problem: str, supported: str) -> IncompatibleVersion:
    """The error for ``entry_point`` of ``distribution``: ``"jax 0.12.0: jax._src.x is missing; ..."``."""
    return IncompatibleVersion(
        f"{distribution} {installed_version(distribution)}: {entry_point} {problem}; "
        f"elastic-runtime supports {distribution} {supported}"
    )
