"""Storage tiers: RAM snapshots, the persistent disk and GCS tiers, the manifest and the cascade."""

# The runtime package imports storage.ram while it initializes; importing it first makes `import storage`
# (or `from storage.disk import ...`) work as the first import of a program too.
import runtime as _runtime  # noqa: F401  isort: skip
from storage.ram import HostSnapshot, RamTier

__all__ = ["HostSnapshot", "RamTier"]
