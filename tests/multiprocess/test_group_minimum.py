"""The script handlers' agreement at a step boundary (``collectives.GroupMinimum``): every process of a real
``jax.distributed`` group learns the smallest of the numbers the processes bring (the newest notification every
member holds), not its own or the largest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elastic_runtime.testing.gcs_emulator import free_port

MAIN = Path(__file__).with_name("group_minimum_main.py")


def test_every_process_learns_the_smallest_of_the_groups_numbers() -> None:
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(MAIN), str(i), coordinator],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(3)
    ]
    outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    answers = [[line for line in out.splitlines() if line.startswith("minimum ")] for out in outputs]
    assert answers == [["minimum 3 10"]] * 3, outputs
