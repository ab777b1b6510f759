"""The flax nnx + optax example (examples/flax_lm.py), as a user runs it: a slice lost after the background
compiles recovers without compiling; a crashed run resumes to a state bitwise equal to a fault-free one."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from elastic_runtime import (
    CheckpointCommitted,
    ElasticRuntime,
    MeshPolicy,
    MeshReady,
    RecoveryCompleted,
    RuntimeConfig,
    RuntimeContext,
    read_events,
)
from elastic_runtime.core.compare import compare_states
from elastic_runtime.testing import FaultInjector

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flax_lm.py"
SLICE_0 = (0, 1)  # compiled ahead first: the shortest wait


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("flax_lm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["flax_lm"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_slice_lost_after_its_mesh_was_compiled_ahead_recovers_without_compiling(tmp_path: Path) -> None:
    example = load_example()
    job = example.make_job(example.ModelConfig(d_model=32, seq=16), global_batch=48)
    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=48, slice_size=2)
    injector = FaultInjector()
    runtime = injector.attach(ElasticRuntime(job, config=RuntimeConfig(run_dir=str(tmp_path)), mesh_policy=policy))
    ready: list[MeshReady] = []
    recovered: list[RecoveryCompleted] = []
    fault_step: list[int] = []
    survivors_ready = anyio.Event()
    survivors = tuple(d for d in range(8) if d not in SLICE_0)

    @runtime.on(MeshReady)
    async def mesh_ready(event: MeshReady, ctx: RuntimeContext) -> None:
        ready.append(event)
        if event.devices == survivors:
            survivors_ready.set()

    @runtime.on(RecoveryCompleted)
    async def recovery(event: RecoveryCompleted, ctx: RuntimeContext) -> None:
        recovered.append(event)

    async def lose_slice_0_once_its_mesh_is_ready(step: int) -> None:
        # The fault comes after start-up: at step 5, or once the background compile for the mesh without
        # slice 0 is done if later.
        if step == 5:
            with anyio.fail_after(120):
                await survivors_ready.wait()
            fault_step.append(step)
            injector.kill_now(SLICE_0)

    runtime.at_step_boundary(lose_slice_0_once_its_mesh_is_ready)
    result = runtime.run(steps=60)
    assert len(recovered) == 1
    assert recovered[0].compile_wait_s == 0.0 and recovered[0].lost_steps == 0
    assert recovered[0].mesh_shape == {"data": 3, "model": 2}
    # Nothing was compiled for the recovery's mesh after the fault: it was ready before.
    assert [e.step for e in ready if e.devices == survivors] == [e.step for e in ready if e.devices == survivors][:1]
    assert all(e.step < fault_step[0] for e in ready if e.devices == survivors)

    reference = ElasticRuntime(job, config=RuntimeConfig(precompile=False), mesh_policy=policy).run(steps=60)
    comparison = compare_states(result.state, reference.state, bitwise=False)
    assert comparison["match"], comparison


def example_command(*args: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--d-model", "32", *args]


ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def committed_disk_steps(run_dir: Path) -> list[int]:
    if not (run_dir / "events.jsonl").exists():
        return []
    events = read_events(run_dir / "events.jsonl")
    return [e.step for e in events if isinstance(e, CheckpointCommitted) and e.tier == "disk"]


@pytest.mark.timeout(600)  # its own waits bound it (240 s, then 300 s): 33 s quiet, over 120 s at load 10
def test_a_killed_run_resumes_from_disk_bitwise_equal_to_a_fault_free_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    common = ("--run-dir", str(run_dir), "--steps", "40", "--disk-every", "10", "--lose-slice-at", "0")
    # kill -9 from outside once a disk checkpoint has committed (the saves run behind the steps, so which
    # step that is depends on the machine's load).
    training = subprocess.Popen(example_command(*common, "--no-reference"), env=ENV, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not committed_disk_steps(run_dir) and training.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert training.poll() is None, "the run ended before a disk checkpoint committed"
        training.send_signal(signal.SIGKILL)
    finally:
        training.kill()
        training.wait()
    newest = max(committed_disk_steps(run_dir))

    resumed = subprocess.run(example_command(*common, "--resume"), capture_output=True, text=True, env=ENV, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    [restored] = summary["restored"]
    assert restored["source"] == "disk" and restored["step"] >= newest and restored["step"] % 10 == 0
    assert summary["step"] == 40
    assert summary["digest"] == summary["reference_digest"], summary

    report = subprocess.run(
        [sys.executable, "-m", "elastic_runtime.cli", "report", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        env=ENV,
    )
    [restart] = json.loads(report.stdout)["failures"]
    assert restart["kind"] == "ProcessRestart" and restart["restored_from"] == "disk", restart
