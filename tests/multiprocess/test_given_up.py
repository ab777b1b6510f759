"""A generation given up before it formed (``forming.give_up``), on the installed jaxlib: a member waiting in its
start leaves it for the next Form, and the stand-ins that fill the lost seats end that waiting, which otherwise
ends at JAX's initialization timeout by terminating the member's process."""

from __future__ import annotations

import logging
import queue
import subprocess
import time
import types
from typing import TYPE_CHECKING, cast

import msgspec
import pytest

from elastic_runtime.cluster.controller.coordination import free_port, start_coordination_service
from elastic_runtime.cluster.controller.standin import command
from elastic_runtime.cluster.protocol import ENV_CONTROLLER, ENV_WORKER, Form, Lease, Stop
from elastic_runtime.cluster.worker.forming import given_up
from elastic_runtime.cluster.worker.group import join_group
from elastic_runtime.cluster.worker.link import Inbound
from elastic_runtime.cluster.worker.settings import WorkerSettings
from elastic_runtime.compat import jax as jax_compat

if TYPE_CHECKING:
    from elastic_runtime.cluster.worker.loop import Worker

pytestmark = pytest.mark.timeout(120)


def test_a_member_leaves_a_generation_given_up_and_stand_ins_end_its_wait(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="elastic_runtime.cluster.worker.group")
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


def test_what_in_the_inbox_gives_a_generation_up() -> None:
    inbox: queue.Queue[Inbound] = queue.Queue()
    worker = cast("Worker", types.SimpleNamespace(link=types.SimpleNamespace(inbox=inbox)))
    form = Form(generation=2, coordinator="127.0.0.1:1", process_id=0, num_processes=3)
    inbox.put(Lease(seconds=0.6))
    inbox.put(form)  # the same generation's Form, sent again
    inbox.put(Stop(reason="maintenance", hold=True))
    assert not given_up(worker, 2)
    inbox.put(msgspec.structs.replace(form, generation=3))
    assert given_up(worker, 2) and not given_up(worker, 3)
    assert inbox.qsize() == 4  # looked at, not taken: the loop handles them next
    inbox.put(Stop(reason="run over"))
    assert given_up(worker, 3)
