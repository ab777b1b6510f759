"""Storage tiers: RAM snapshots, the persistent disk and GCS tiers, the manifest and the cascade."""

from typing import Any

# The runtime package imports storage.ram while it initializes; importing it first makes `import storage`
# (or `from storage.disk import ...`) work as the first import of a program too.
import runtime as _runtime  # noqa: F401  isort: skip
from storage.ram import HostSnapshot, RamTier

__all__ = [
    "CheckpointInfo",
    "CheckpointTier",
    "DiskTier",
    "GcsTier",
    "HostSnapshot",
    "Manifest",
    "RamTier",
    "TieredCheckpointer",
]

# Loaded on first use: the runtime imports this package while it initializes (before the modules these need
# exist), and google-cloud-storage should cost nothing to a run without a bucket.
_LAZY = {
    "CheckpointInfo": "storage.tier",
    "CheckpointTier": "storage.tier",
    "DiskTier": "storage.disk",
    "GcsTier": "storage.gcs",
    "Manifest": "storage.manifest",
    "TieredCheckpointer": "storage.cascade",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
