"""Silent data corruption in one process: the state's fingerprint finds a replica that differs, the replay tells
a transient flip from a device that computes wrong, and the run heals either way (runtime/core/fingerprint.py,
handlers/integrity.py); a durable checkpoint records the digest of the state it was verified with, and a restore
checks it (storage/tier.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from elastic_runtime import (
    CorruptionHealed,
    ElasticRuntime,
    MeshChanged,
    MeshPolicy,
    RecoveryCompleted,
    RuntimeConfig,
    SilentCorruption,
    read_events,
)
from elastic_runtime.analysis.goodput import goodput
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.compiler import StepCompiler
from elastic_runtime.core.errors import CheckpointInvalid
from elastic_runtime.core.fingerprint import (
    STATE_DIGEST,
    Fingerprinter,
    compare_replicas,
    host_digest,
    read_digests,
    state_digest,
)
from elastic_runtime.core.restore import restore_newest
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.testing import FaultInjector
from elastic_runtime.testing.demo_model import demo_job
from elastic_runtime.testing.faults import flip_a_bit

STEPS = 40
POLICY = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2)


def small_job() -> Any:
    return demo_job(global_batch=24, features=16, hidden=64)


def placed(tree: Any, spec: P | None = None) -> Any:
    mesh = POLICY.fit(jax.devices())
    return jax.device_put(tree, NamedSharding(mesh, spec or P()))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int64, jnp.bool_, jnp.uint8])
def test_every_replica_has_the_same_digest_and_one_flipped_bit_is_found_on_its_device(dtype: Any) -> None:
    values = (np.arange(64 * 6).reshape(64, 6) % 7).astype(np.dtype(dtype)) if dtype != jnp.bool_ else None
    tree = {"a": placed(values if values is not None else np.arange(64 * 6).reshape(64, 6) % 2 == 0)}
    tree["f"] = placed(np.ones((8, 4), np.float32), P(None, "model"))  # split over model: compared per block
    fingerprinter = Fingerprinter("data")
    digests, mesh = fingerprinter.digests(tree)
    assert compare_replicas(digests, mesh, "data", step=1) is None
    bad, hit = flip_a_bit({"f": tree["f"]}, device=3)
    assert hit
    digests, mesh = fingerprinter.digests({"a": tree["a"], "f": bad["f"]})
    found = compare_replicas(digests, mesh, "data", step=2)
    assert found is not None and found.suspects == (3,) and found.attributed and found.replicas == 4


def test_two_replicas_that_differ_cannot_say_which_is_wrong() -> None:
    small = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    tree = jax.device_put(np.ones((4, 4), np.float32), NamedSharding(small, P()))
    bad, _ = flip_a_bit(tree, device=small.devices[1, 0].id)
    digests, mesh = Fingerprinter("data").digests(bad)
    found = compare_replicas(digests, mesh, "data", step=5)
    assert found is not None and not found.attributed
    assert set(found.suspects) == {small.devices[0, 0].id, small.devices[1, 0].id}


@pytest.mark.parametrize("specs", ["per leaf", "one for all"])
def test_a_step_compiled_with_its_fingerprint_returns_the_same_digests_as_the_program_beside_it(specs: str) -> None:
    """Under launch the step computes and gathers the digests itself (``StepCompiler(fingerprint=...)``): the same
    numbers as the fingerprint's own program, so a copy that computes wrong is found the same way; with the state's
    specs given leaf by leaf, or as one prefix for the whole state."""
    job = small_job() if specs == "per leaf" else dataclasses.replace(small_job(), state_specs=P())
    mesh = POLICY.fit(jax.devices())
    state = job.init()
    plain = StepCompiler(job, state, job.data.batch(0))
    fused = StepCompiler(job, state, job.data.batch(0), fingerprint="data")
    placed_state = jax.device_put(state, plain.state_shardings(mesh))
    batch = jax.device_put(job.data.batch(0), plain.batch_shardings(mesh))
    new_state, _ = plain.get(mesh)(placed_state, batch)
    same_state, _, out = fused.get(mesh)(placed_state, batch)
    fingerprinter = Fingerprinter("data")
    expected, _ = fingerprinter.digests(new_state)
    digests = read_digests(out, mesh)
    assert compare_states(same_state, new_state, bitwise=True)["match"]
    assert digests.shape == mesh.devices.shape and np.array_equal(digests, expected)
    assert compare_replicas(digests, mesh, "data", step=1) is None
    # A copy read wrong on one device computes a different step there (after a step: the initial momentum's zeros
    # flipped make a denormal, which the CPU flushes to zero).
    bad, hit = flip_a_bit(same_state, device=5)
    assert hit
    _, _, out = fused.get(mesh)(bad, batch)
    found = compare_replicas(read_digests(out, mesh), mesh, "data", step=1)
    assert found is not None and 5 in found.suspects


@pytest.fixture(scope="module")
def reference() -> Any:
    config = RuntimeConfig(precompile=False, progress=False, scale_up_poll_s=None, fingerprint_every=0)
    return ElasticRuntime(small_job(), config=config, mesh_policy=POLICY).run(STEPS).state


def corrupted_run(tmp_path: Path, *, persistent: bool) -> tuple[Any, list[Any], FaultInjector]:
    config = RuntimeConfig(run_dir=str(tmp_path), precompile=False, scale_up_poll_s=None, fingerprint_every=1)
    injector = FaultInjector().corrupt(12, device=5, persistent=persistent)
    result = injector.attach(ElasticRuntime(small_job(), config=config, mesh_policy=POLICY)).run(STEPS)
    return result, read_events(tmp_path / "events.jsonl"), injector


def test_a_transient_flip_is_found_at_the_next_step_and_healed_by_replay_bitwise(
    tmp_path: Path, reference: Any
) -> None:
    result, events, injector = corrupted_run(tmp_path, persistent=False)
    assert injector.corrupted and injector.corrupted[0] == (13, 5)  # the state step 13 read
    [found] = [e for e in events if isinstance(e, SilentCorruption)]
    assert found.step <= 14 and found.suspects == (5,) and found.attributed and not found.persistent
    [healed] = [e for e in events if isinstance(e, CorruptionHealed)]
    assert (healed.kind, healed.suspects, healed.evicted) == ("transient", (5,), ())
    [recovery] = [e for e in events if isinstance(e, RecoveryCompleted)]
    assert recovery.lost_steps == 0
    assert not [e for e in events if isinstance(e, MeshChanged)]  # no device evicted
    assert compare_states(result.state, reference, bitwise=True)["match"]
    report = goodput(events)  # booked as its own badput category, not as a lost device's recovery
    assert [f.kind for f in report.failures] == ["SilentCorruption"]
    assert (
        report.badput_s["INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"] == 0.0
        and "SILENT_DATA_CORRUPTION" in report.badput_s
    )


def test_a_device_that_computes_wrong_is_evicted_and_the_run_stays_within_tolerance(
    tmp_path: Path, reference: Any
) -> None:
    result, events, _ = corrupted_run(tmp_path, persistent=True)
    found = [e for e in events if isinstance(e, SilentCorruption)]
    assert [(e.suspects, e.persistent) for e in found] == [((5,), False), ((5,), True)]  # replayed, came back
    [healed] = [e for e in events if isinstance(e, CorruptionHealed)]
    assert (healed.kind, healed.evicted) == ("persistent", (5,))
    [change] = [e for e in events if isinstance(e, MeshChanged)]
    assert 5 not in change.devices and change.new_shape == {"data": 3, "model": 2}
    assert result.step == STEPS and compare_states(result.state, reference, bitwise=False)["match"]


def test_fault_free_runs_raise_no_false_alarm(tmp_path: Path, reference: Any) -> None:
    config = RuntimeConfig(run_dir=str(tmp_path), precompile=False, scale_up_poll_s=None, fingerprint_every=1)
    result = ElasticRuntime(small_job(), config=config, mesh_policy=POLICY).run(STEPS)
    events = read_events(tmp_path / "events.jsonl")
    assert not [e for e in events if isinstance(e, SilentCorruption | CorruptionHealed)]
    assert compare_states(result.state, reference, bitwise=True)["match"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_, jnp.uint8])
def test_the_state_digest_is_the_same_on_every_mesh_and_in_host_memory_and_one_flipped_bit_changes_it(
    dtype: Any,
) -> None:
    rng = np.random.default_rng(0)
    values = rng.random((16, 8)) > 0.5 if dtype == jnp.bool_ else rng.integers(0, 200, (16, 8)).astype(dtype)
    tree = {"a": values, "b": np.arange(24, dtype=np.int32).reshape(8, 3)}
    host = host_digest(jax.tree.leaves(tree))
    devices = np.array(jax.devices())
    for shape in [(4, 2), (2, 4), (8, 1)]:  # blocks of other sizes on other devices: the same number
        mesh = Mesh(devices.reshape(shape), ("data", "model"))
        on_mesh = {
            "a": jax.device_put(tree["a"], NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(tree["b"], NamedSharding(mesh, P("data"))),
        }
        assert state_digest(on_mesh) == host, shape
    flipped = tree["a"].copy()
    flipped.reshape(-1).view(np.uint8)[37] ^= 1
    assert host_digest([flipped, tree["b"]]) != host


def test_a_durable_checkpoint_records_the_verified_states_digest_and_a_state_changed_before_its_write_is_refused(
    tmp_path: Path,
) -> None:
    config = RuntimeConfig(run_dir=str(tmp_path), precompile=False, progress=False, scale_up_poll_s=None, disk_every=10)
    result = ElasticRuntime(small_job(), config=config, mesh_policy=POLICY).run(20)
    disk = DiskTier(tmp_path / "checkpoints")
    snapshot = disk.restore(20, timeout=60)
    assert snapshot.metadata[STATE_DIGEST] == f"{state_digest(result.state):08x}"
    # The host copy changed after the check and before the write: its files and their CRC32Cs agree, the state
    # is not the one verified on the devices.
    leaves, treedef = jax.tree.flatten(snapshot.tree)
    changed = [np.array(leaf, copy=True) for leaf in leaves]
    changed[0].reshape(-1).view(np.uint8)[0] ^= 1
    tree = jax.tree.unflatten(treedef, changed)
    metadata = snapshot.metadata
    disk.save(HostSnapshot(step=30, data_position=31, tree=tree, nbytes=0, seconds=0.0, metadata=metadata), timeout=60)
    refused: list[int] = []
    disk.corruption_listeners.append(lambda tier, step, exc: refused.append(step))
    with pytest.raises(CheckpointInvalid, match="digest"):
        disk.restore(30, timeout=60)
    _, newest = restore_newest([disk], timeout=60)
    assert newest.step == 20 and refused == [30]  # reported once, by the restore that went on to step 20


def test_under_launch_the_slices_are_compared_after_every_step_or_not_at_all() -> None:
    # A divergence found there is replayed from the state its step read: a sparser cadence would need older ones.
    from elastic_runtime.cluster.worker import run_worker
    from elastic_runtime.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"fingerprint_every=10 under .*after every step \(1\) or not at all"):
        run_worker(small_job(), 5, fingerprint_every=10)
