"""elastic_runtime.compat: each private entry point works on the installed versions, and its loss is named clearly."""

from __future__ import annotations

import json
import re
import sys
import types
from importlib import metadata
from pathlib import Path

import jax
import jaxlib._jax
import numpy as np
import pytest

from elastic_runtime.cluster.controller.coordination import free_port, start_coordination_service
from elastic_runtime.cluster.protocol import ENV_CONTROLLER, ENV_WORKER, Form
from elastic_runtime.cluster.worker.group import join_group
from elastic_runtime.cluster.worker.settings import WorkerSettings
from elastic_runtime.compat import cloud_storage as cloud_storage_compat
from elastic_runtime.compat import jax as jax_compat
from elastic_runtime.compat import orbax as orbax_compat
from elastic_runtime.compat.errors import IncompatibleVersion


def _names(distribution: str, entry_point: str) -> str:
    """The start of the error for ``entry_point``: the distribution, its installed version, the entry point."""
    return re.escape(f"{distribution} {metadata.version(distribution)}: {entry_point} ")


# --- jax and jaxlib ----------------------------------------------------------------------------------------


def test_distributed_state_has_the_fields_the_worker_sets() -> None:
    state = jax_compat.distributed_state()
    assert state is jax._src.distributed.global_state
    assert state.client is None  # the test process never joined a group


def test_a_service_and_a_client_connect_on_the_installed_jaxlib() -> None:
    port = free_port()
    service = jax_compat.distributed_runtime_service(
        f"127.0.0.1:{port}", 1, heartbeat_timeout=10, shutdown_timeout=2, recoverable=True
    )
    try:
        client = jax_compat.distributed_runtime_client(
            f"127.0.0.1:{port}", 0, init_timeout=10, use_compression=True, heartbeat_timeout=10, shutdown_timeout=2
        )
        client.connect()
        client.key_value_set("compat", "ok")
        assert client.blocking_key_value_get("compat", 1000) == "ok"
        client.shutdown()
    finally:
        service.shutdown()


def test_missing_global_state_is_named_with_the_jax_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(jax._src.distributed, "global_state")
    with pytest.raises(IncompatibleVersion, match=_names("jax", "jax._src.distributed.global_state") + "is missing"):
        jax_compat.distributed_state()


def test_a_missing_state_field_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax._src.distributed, "global_state", types.SimpleNamespace(client=None))
    with pytest.raises(
        IncompatibleVersion, match=_names("jax", "jax._src.distributed.global_state.coordinator_address")
    ):
        jax_compat.distributed_state()


def jaxlib_without_entry_points() -> types.SimpleNamespace:
    """A jaxlib without the distributed runtime's entry points. It keeps ``collect_garbage``, which JAX's
    callback in ``gc.callbacks`` calls whenever a collection runs during the test."""
    kept = {name: getattr(jax._src.lib._jax, name) for name in ("collect_garbage",) if hasattr(jax._src.lib._jax, name)}
    return types.SimpleNamespace(**kept)


def test_the_worker_fails_with_the_compat_error_not_an_attribute_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax._src.lib, "_jax", jaxlib_without_entry_points())
    form = Form(generation=1, coordinator="127.0.0.1:1", process_id=0, num_processes=1)
    entry_point = "jax._src.lib._jax.get_distributed_runtime_client"
    with pytest.raises(IncompatibleVersion, match=_names("jaxlib", entry_point) + "is missing; .* supports jaxlib"):
        join_group(form, WorkerSettings.from_env({ENV_CONTROLLER: "127.0.0.1:1", ENV_WORKER: "0"}), lambda: False)


def test_the_controller_fails_with_the_compat_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The controller takes the service from jaxlib's extension itself (it never imports JAX).
    monkeypatch.setitem(sys.modules, "jaxlib._jax", jaxlib_without_entry_points())
    entry_point = "jaxlib._jax.get_distributed_runtime_service"
    with pytest.raises(IncompatibleVersion, match=_names("jaxlib", entry_point) + "is missing"):
        start_coordination_service("127.0.0.1", free_port(), 2)


def test_a_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def older(address: str, num_nodes: int) -> None:  # a jaxlib whose service takes no keyword arguments
        raise AssertionError("not reached")

    monkeypatch.setattr(jaxlib._jax, "get_distributed_runtime_service", older)
    entry_point = "jaxlib._jax.get_distributed_runtime_service"
    with pytest.raises(IncompatibleVersion, match=_names("jaxlib", entry_point) + "changed its arguments"):
        start_coordination_service("127.0.0.1", free_port(), 2)


# --- orbax-checkpoint --------------------------------------------------------------------------------------


def test_the_handler_name_is_what_orbax_writes(tmp_path: Path) -> None:
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as checkpointer:
        checkpointer.save(tmp_path / "state", args=ocp.args.PyTreeSave({"w": np.zeros(3)}))
    written = json.loads((tmp_path / "state" / "_CHECKPOINT_METADATA").read_text())
    assert written["item_handlers"] == orbax_compat.pytree_handler_name()


def test_a_missing_orbax_handler_is_named_with_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import orbax.checkpoint as ocp

    orbax_compat.pytree_handler_name.cache_clear()
    monkeypatch.delattr(ocp, "PyTreeCheckpointHandler")
    entry_point = "orbax.checkpoint.PyTreeCheckpointHandler"
    try:
        with pytest.raises(IncompatibleVersion, match=_names("orbax-checkpoint", entry_point) + "is missing"):
            orbax_compat.pytree_handler_name()
    finally:
        orbax_compat.pytree_handler_name.cache_clear()


# --- google-cloud-storage ----------------------------------------------------------------------------------


def _client() -> object:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    return storage.Client(project="compat-test", credentials=AnonymousCredentials())


def test_the_storage_client_has_an_authorized_session() -> None:
    http = cloud_storage_compat.authorized_session(_client())
    assert callable(http.put) and callable(http.get)


def test_a_missing_storage_session_is_named_with_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from google.cloud import client as cloud_client

    monkeypatch.delattr(cloud_client.Client, "_http")
    entry_point = "google.cloud.storage.Client._http"
    with pytest.raises(IncompatibleVersion, match=_names("google-cloud-storage", entry_point) + "is missing"):
        cloud_storage_compat.authorized_session(_client())


def test_xla_cpu_collective_timeouts_are_set_unless_the_user_set_them() -> None:
    from elastic_runtime.compat.xla import COLLECTIVE_FLAG, ENV_COLLECTIVE_TIMEOUT, FLAG, SECONDS, set_flags

    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    set_flags(environ)  # outside a worker: only the terminate timeout, raised
    assert environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {FLAG}={SECONDS}"
    worker = {ENV_COLLECTIVE_TIMEOUT: "20.0"}  # a worker its controller started
    set_flags(worker)
    assert worker["XLA_FLAGS"] == f"{FLAG}={SECONDS} {COLLECTIVE_FLAG}=20"
    mine = {"XLA_FLAGS": f"{FLAG}=5 {COLLECTIVE_FLAG}=600", ENV_COLLECTIVE_TIMEOUT: "20"}
    set_flags(mine)
    assert mine["XLA_FLAGS"] == f"{FLAG}=5 {COLLECTIVE_FLAG}=600"
    # In a new process, importing the package is enough (XLA reads the flags when its first backend starts).
    import subprocess
    import sys

    code = "import os, runtime, jax; jax.devices(); print(os.environ['XLA_FLAGS'])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={ENV_COLLECTIVE_TIMEOUT: "45"}
    )
    assert f"{FLAG}={SECONDS}" in out.stdout and f"{COLLECTIVE_FLAG}=45" in out.stdout


def test_a_workers_collective_timeout_follows_the_hang_timeout() -> None:
    from elastic_runtime.cluster.config import LaunchConfig

    def timeout(**settings: float) -> float:
        return LaunchConfig(command=["python", "train.py"], nprocs=2, **settings).collective_timeout_s

    assert timeout() == 10.0  # the defaults: 5 s hang
    assert timeout(hang_timeout_s=60.0) == 120.0
    assert timeout(hang_timeout_s=1.0) == 10.0  # the floor
    assert timeout(form_timeout_s=90.0) == 10.0  # a slow forming waits at meeting points, not in a collective
    assert timeout(hang_timeout_s=600.0) == 240.0  # below XLA's 300 s abort
