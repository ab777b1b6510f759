"""Checkpoint tiers below RAM: ``/dev/shm``, the persistent disk and GCS, the manifest, and the cascade.

The RAM tier lives with the executor (``elastic_runtime.core.snapshot``), which compiles its copy into the step.
``GcsTier`` is imported from ``elastic_runtime.storage.gcs``: google-cloud-storage costs nothing to a run without a
bucket. Each name here is imported on first use (``elastic_runtime.core.lazy``): the controller reads manifests
(``elastic_runtime.storage.manifest``) without the tiers' JAX.
"""

from typing import TYPE_CHECKING

from elastic_runtime.core.lazy import lazy_exports

__all__ = ["CheckpointInfo", "CheckpointTier", "DiskTier", "Manifest", "TieredCheckpointer"]

if TYPE_CHECKING:
    from elastic_runtime.storage.cascade import TieredCheckpointer
    from elastic_runtime.storage.disk import DiskTier
    from elastic_runtime.storage.manifest import Manifest
    from elastic_runtime.storage.tier import CheckpointInfo, CheckpointTier

_HOMES = {
    "elastic_runtime.storage.cascade": ["TieredCheckpointer"],
    "elastic_runtime.storage.disk": ["DiskTier"],
    "elastic_runtime.storage.manifest": ["Manifest"],
    "elastic_runtime.storage.tier": ["CheckpointInfo", "CheckpointTier"],
}
__getattr__ = lazy_exports(__name__, _HOMES)

if __name__ != "elastic_runtime.storage":  # this file run under its old import name, `storage` (compat/old_names.py)
    from elastic_runtime.compat.old_names import redirect

    redirect(__name__)
