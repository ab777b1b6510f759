"""Checkpoint tiers below RAM: ``/dev/shm``, the persistent disk and GCS, the manifest, and the cascade.

The RAM tier lives with the executor (``runtime.core.snapshot``), which compiles its copy into the step.
``GcsTier`` is imported from ``storage.gcs``: google-cloud-storage costs nothing to a run without a bucket.
Each name here is imported on first use (``runtime.core.lazy``): the controller reads manifests
(``storage.manifest``) without the tiers' JAX.
"""

from typing import TYPE_CHECKING

from runtime.core.lazy import lazy_exports

__all__ = ["CheckpointInfo", "CheckpointTier", "DiskTier", "Manifest", "TieredCheckpointer"]

if TYPE_CHECKING:
    from storage.cascade import TieredCheckpointer
    from storage.disk import DiskTier
    from storage.manifest import Manifest
    from storage.tier import CheckpointInfo, CheckpointTier

_HOMES = {
    "storage.cascade": ["TieredCheckpointer"],
    "storage.disk": ["DiskTier"],
    "storage.manifest": ["Manifest"],
    "storage.tier": ["CheckpointInfo", "CheckpointTier"],
}
__getattr__ = lazy_exports(__name__, _HOMES)
