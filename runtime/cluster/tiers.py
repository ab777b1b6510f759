"""The names of the places a worker holds a step's shards, one name per tier, on the wire and in the plan."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Tier"]


class Tier(StrEnum):
    """Where a worker holds (or read) its shards of a step. A message naming any other tier does not decode."""

    RAM = "ram"  # its own host memory (the RAM replica)
    SHM = "shm"  # its replica files, in /dev/shm
    DISK = "disk"  # its replica files, on a disk folder
    FILE = "file"  # one of its replica files, not its newest (in the plan: shm or disk)
    DURABLE = "durable"  # the group's durable checkpoint (storage/sharded.py), on disk or in GCS
    NEIGHBOUR = "neighbour"  # the next process's neighbour replica (elastic_runtime.cluster.collectives.NeighbourShift)
    NONE = "none"  # nothing: it takes every shard from its peers, or the run starts from the initial state
