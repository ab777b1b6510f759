"""One process of ``test_group_minimum.py``: a ``jax.distributed`` group of three processes of two CPU devices each,
every one asking ``GroupMinimum`` for the smallest of the numbers the processes bring, twice (the program built
once is used again)."""

from __future__ import annotations

import os
import sys

import elastic_runtime  # noqa: F401  # sets the collective timeout before JAX starts

process_id, coordinator = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

from elastic_runtime.cluster.collectives import GroupMinimum  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator, num_processes=3, process_id=process_id)
minimum = GroupMinimum()
first = minimum([7, 3, 5][process_id])  # the smallest is process 1's
second = minimum([0, 9, 4][process_id] + 10)  # and now process 0's
print("minimum", first, second, flush=True)
jax.distributed.shutdown()
