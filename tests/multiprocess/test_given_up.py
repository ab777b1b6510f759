"""A generation given up before it formed (``forming.give_up``), on the installed jaxlib: a member waiting in its
start leaves it for the next Form, and the stand-ins that fill the lost seats end that waiting, which otherwise
ends at JAX's initialization timeout by terminating the member's process."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest

from runtime.cluster.controller.coordination import free_port, start_coordination_service
from runtime.cluster.controller.standin import command
from runtime.cluster.protocol import ENV_CONTROLLER, ENV_WORKER, Form
from runtime.cluster.worker.group import join_group
from runtime.cluster.worker.settings import WorkerSettings
from runtime.compat import jax as jax_compat

pytestmark = pytest.mark.timeout(120)


def test_a_member_leaves_a_generation_given_up_and_stand_ins_end_its_wait(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="runtime.cluster.worker.group")
    port = free_port()
    service = start_coordination_service("127.0.0.1", port, 3)
    try:
        form = Form(generation=2, coordinator=f"127.0.0.1:{port}", process_id=0, num_processes=3)
        settings = WorkerSettings.from_env({ENV_CONTROLLER: "127.0.0.1:1", ENV_WORKER: "0"})
        looks = 0

        def given_up() -> bool:  # the next Form arrives while the member waits for seats 1 and 2
            nonlocal looks
            looks += 1
            return looks >= 3

        assert join_group(form, settings, given_up) is False
        assert jax_compat.distributed_state().client is None  # free to join the next generation
        assert "left generation 2" not in caplog.text  # still waiting in its thread: seats 1 and 2 are empty

        standins = subprocess.run(command(form.coordinator, (1, 2)), capture_output=True, timeout=90)
        assert standins.returncode == 0, standins.stdout.decode() + standins.stderr.decode()
        deadline = time.monotonic() + 60
        while "left generation 2, given up before it formed" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
    finally:
        service.shutdown()
