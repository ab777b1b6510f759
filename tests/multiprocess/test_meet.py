"""A meeting point before a collective (``elastic_runtime.cluster.worker.group.meet``): two real ``jax.distributed``
processes, one late by host work longer than the collective timeout. Met first, the collective runs; not met,
the early one's collective times out. A meeting nobody else comes to ends at its timeout, when abandoned, or
when the group is left (an abandoned restore's thread)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runtime.compat.xla import ENV_COLLECTIVE_TIMEOUT
from elastic_runtime.testing.gcs_emulator import free_port

MAIN = Path(__file__).with_name("meet_main.py")


def run_pair(mode: str) -> list[str]:
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, ENV_COLLECTIVE_TIMEOUT: "2", "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(MAIN), str(i), coordinator, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        outputs.append(out)
    return outputs


@pytest.fixture(scope="module")
def met() -> list[str]:
    return run_pair("meet")


def test_a_late_member_is_waited_for_at_the_meeting_not_in_the_collective(met: list[str]) -> None:
    first, second = met
    assert "sum 2.0" in first and "sum 2.0" in second, (first, second)


def test_without_the_meeting_the_early_members_collective_times_out() -> None:
    first, _ = run_pair("no-meet")
    assert "collective failed" in first and "Timed out" in first, first


def test_a_meeting_ends_at_its_timeout_when_abandoned_and_when_the_group_is_left(met: list[str]) -> None:
    first, _ = met
    assert "timed out after" in first and "not every one of 2 processes came in 0.5 s" in first, first
    assert "abandoned: meeting 'abandoned': abandoned" in first, first
    assert "left: meeting 'left': the group was left while waiting" in first, first
