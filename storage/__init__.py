"""Checkpoint tiers below RAM: ``/dev/shm``, the persistent disk and GCS, the manifest, and the cascade.

The RAM tier lives with the executor (``runtime.core.snapshot``), which compiles its copy into the step.
``GcsTier`` is imported from ``storage.gcs``: google-cloud-storage costs nothing to a run without a bucket.
"""

from storage.cascade import TieredCheckpointer
from storage.disk import DiskTier
from storage.manifest import Manifest
from storage.tier import CheckpointInfo, CheckpointTier

__all__ = ["CheckpointInfo", "CheckpointTier", "DiskTier", "Manifest", "TieredCheckpointer"]
