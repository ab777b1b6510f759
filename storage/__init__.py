"""Storage tiers: RAM snapshots now; persistent disk and GCS build on them."""

from storage.ram import HostSnapshot, RamTier

__all__ = ["HostSnapshot", "RamTier"]
