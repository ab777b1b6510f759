"""The training script's own handlers run under ``launch`` too, and controller-side ones are named on the CLI.
Real worker processes, a real ``kill -9``, no mocks.

- handlers registered on the script's ``ElasticRuntime`` (as ``examples/custom_handler.py`` registers them)
  fire in every process of the group once for each of the group's events (the lost worker, the re-forming,
  the restore), all at the same step boundary, with ``ctx.lead`` true in one process only;
- their ``ctx.transform_state`` acts: the final state differs from the same run without it, and the
  controller's log says ``StateTransformed`` once; their ``ctx.request_checkpoint`` commits a durable
  checkpoint of that step (``launch --durable``);
- ``ctx.abort`` ends the run with the handler's reason, and ``ctx.remesh`` (impossible here) and
  ``ctx.request_checkpoint`` without a durable tier are each a ``HandlerFailed`` naming why, not a silent
  no-op;
- ``launch --handlers package.module:function`` subscribes a controller-side handler, run once per event.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from launch_support import NPROCS, STEPS

from elastic_runtime.cli.demo_multiprocess import run_group
from elastic_runtime.cluster.controller.named_handlers import load_handler, script_folder
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import (
    CheckpointCommitted,
    Event,
    GroupFormed,
    HandlerFailed,
    StateRestored,
    StateTransformed,
)
from elastic_runtime.faults.grammar import parse_faults

HERE = Path(__file__).parent
SCRIPT = HERE / "handlers_train.py"
KILL_AT = 10

pytestmark = pytest.mark.timeout(600)


def launched(run_dir: Path, *flags: str, **extra: Any) -> Any:
    out = run_dir / "handlers"
    out.mkdir(parents=True)
    command = [sys.executable, str(SCRIPT), "--steps", str(STEPS), "--out", str(out), *flags]
    faults = parse_faults(f"kill:1@{KILL_AT}")
    return run_group(processes=NPROCS, steps=STEPS, run_dir=run_dir, faults=faults, command=command, **extra)


def returned(run_dir: Path) -> list[dict[str, Any]]:
    """What ``run()`` returned in each worker process that finished the run."""
    return [json.loads(path.read_text()) for path in sorted((run_dir / "handlers").glob("after-*.json"))]


def records(run_dir: Path) -> list[dict[str, Any]]:
    lines = [line for path in sorted((run_dir / "handlers").glob("*.jsonl")) for line in path.read_text().splitlines()]
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """kill -9 of process 1 at step 10, the script's handlers recording, and a controller-side handler."""
    run_dir = tmp_path_factory.mktemp("plain")
    os.environ["HANDLERS_TEST_CONTROLLER_OUT"] = str(run_dir / "controller.jsonl")
    # No --result: the script's run() asks for no final state either (test_run_returns_in_every_worker_...).
    result = launched(run_dir, handlers=["handlers_train:count_on_controller"], result_path=None)
    assert result.ok and result.step == STEPS and len(result.recoveries) == 1
    return run_dir, result


def test_the_scripts_handlers_fire_once_in_every_process_for_the_groups_events(plain: tuple[Path, Any]) -> None:
    run_dir, _ = plain
    seen = records(run_dir)
    recovered = [r for r in seen if r["generation"] == 2]
    # The re-formed group: every one of its processes saw the loss, the re-forming and the restore once each.
    for kind in ("WorkerLost", "GroupFormed", "StateRestored", "RecoveryCompleted"):
        got = [r for r in recovered if r["event"] == kind]
        assert sorted(r["process"] for r in got) == list(range(NPROCS)), (kind, got)
        assert [r["lead"] for r in got].count(True) == 1 and all(r["lead"] == (r["process"] == 0) for r in got)
        assert len({r["at"] for r in got}) == 1, f"{kind} ran at different step boundaries: {got}"
    [restored] = [e for e in read_events(run_dir / "events.jsonl") if isinstance(e, StateRestored)]
    assert {r["step"] for r in recovered if r["event"] == "StateRestored"} == {restored.step}
    # The first group saw its own forming, and nothing of the second's.
    first = Counter(r["event"] for r in seen if r["generation"] == 1)
    assert first == Counter({"GroupFormed": NPROCS})


def test_run_returns_in_every_worker_without_the_state_unless_the_script_asks(plain: tuple[Path, Any]) -> None:
    run_dir, result = plain
    after = returned(run_dir)
    assert len(after) == NPROCS and all(r["step"] == STEPS for r in after) and sum(r["lead"] for r in after) == 1
    # Not asked for (``run(gather=True)``): no process gathered the state; the group still agreed on its digest.
    assert not any(r["has_state"] for r in after)
    assert len(result.digests) >= NPROCS and len(set(result.digests.values())) == 1


def test_a_controller_side_handler_named_in_the_config_runs_once_per_event(plain: tuple[Path, Any]) -> None:
    run_dir, _ = plain
    lines = [json.loads(line) for line in (run_dir / "controller.jsonl").read_text().splitlines()]
    events = read_events(run_dir / "events.jsonl")
    formed = [e.step for e in events if isinstance(e, GroupFormed)]
    restored = [e.step for e in events if isinstance(e, StateRestored)]
    assert [r["step"] for r in lines if r["event"] == "GroupFormed"] == formed and len(formed) == 2
    assert [r["step"] for r in lines if r["event"] == "StateRestored"] == restored and len(restored) == 1


def test_a_transform_and_a_checkpoint_asked_for_on_state_restored_act(plain: tuple[Path, Any], tmp_path: Path) -> None:
    _, without = plain
    # No periodic durable checkpoint within the run (every 100 steps): the one committed is the handler's.
    durable = {"durable_dir": str(tmp_path / "durable"), "durable_every": 100}
    result = launched(tmp_path, "--scale", "0.5", "--checkpoint-on", "StateRestored", **durable)
    assert result.ok and result.step == STEPS
    # Every member applied it at the same step (else the replicas would disagree and ok would be False) ...
    assert len(set(result.digests.values())) == 1
    # ... and it changed the state: the same run without it ends elsewhere.
    assert set(result.digests.values()) != set(without.digests.values())
    events = read_events(tmp_path / "events.jsonl")
    [transformed] = [e for e in events if isinstance(e, StateTransformed)]
    [restored] = [e for e in events if isinstance(e, StateRestored)]
    assert transformed.reason == "scale by 0.5 after a restore" and transformed.step >= restored.step
    [committed] = [e for e in events if isinstance(e, CheckpointCommitted)]
    assert committed.tier == "durable" and committed.step == transformed.step  # the same boundary


def test_abort_ends_the_run_and_an_impossible_request_is_a_handler_failure(tmp_path: Path) -> None:
    """Through the CLI, with a controller-side handler named by ``--handlers``: the module is found in the
    current folder."""
    out = tmp_path / "handlers"
    out.mkdir()
    command = [sys.executable, "-m", "elastic_runtime.cli", "launch", "--nprocs", "2", "--steps", "10"]
    command += ["--run-dir", str(tmp_path / "run"), "--handlers", "handlers_train:count_on_controller"]
    command += ["--", sys.executable, str(SCRIPT), "--steps", "10", "--out", str(out), "--abort"]
    command += ["--checkpoint-on", "GroupFormed"]
    env = os.environ | {"HANDLERS_TEST_CONTROLLER_OUT": str(tmp_path / "controller.jsonl")}
    done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RecoveryError" in done.stdout + done.stderr or "giving up on purpose" in done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ok"] is False and "generation 1 formed: giving up on purpose" in summary["reason"]
    events = read_events(tmp_path / "run" / "events.jsonl")
    failed = {e.handler.rsplit(".", 1)[-1]: e for e in events if isinstance(e, HandlerFailed)}
    assert sorted(failed) == ["checkpoint", "try_remesh"]  # once each: sent by the lead process only
    assert all(e.error_type == "UnsupportedInMode" and e.event_type == "GroupFormed" for e in failed.values())
    assert "ctx.remesh is not available under `elastic-runtime launch`" in failed["try_remesh"].message
    assert "needs a durable tier" in failed["checkpoint"].message
    lines = (tmp_path / "controller.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["GroupFormed"]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("handlers_train", "package.module:function"),
        ("no_such_module_here:f", "cannot import"),
        ("handlers_train:nothing", "has no nothing"),
        ("handlers_train:main", "async def"),
        ("handlers_train:record", "async def"),
    ],
)
def test_a_named_handler_that_cannot_be_loaded_is_a_config_error(spec: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        load_handler(spec)


def test_a_named_handler_is_subscribed_for_its_annotated_event_types() -> None:
    kinds, handler = load_handler("handlers_train:count_on_controller")
    assert kinds == (GroupFormed, StateRestored) and handler.__name__ == "count_on_controller"


def test_a_named_handler_is_found_beside_the_script_first_and_its_errors_name_the_file(tmp_path: Path) -> None:
    """A user's ``handlers.py`` beside the training script, not the library's handlers (nor one elsewhere on the
    path): before, ``--handlers handlers:on_lost`` loaded the library's package and said only ``has no on_lost``."""
    (tmp_path / "handlers.py").write_text("async def on_lost(event, ctx):\n    pass\n")
    sys.modules.pop("handlers", None)
    try:
        kinds, handler = load_handler("handlers:on_lost", first=[str(tmp_path)])
        assert kinds == (Event,) and handler.__module__ == "handlers"
        assert sys.modules["handlers"].__file__ == str(tmp_path / "handlers.py")
        with pytest.raises(
            ConfigError, match=re.escape(f"(handlers from {tmp_path / 'handlers.py'}): handlers has no other")
        ):
            load_handler("handlers:other", first=[str(tmp_path)])
    finally:
        sys.modules.pop("handlers", None)
        sys.path.remove(str(tmp_path))


def test_the_script_folder_is_the_first_py_file_the_command_runs(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    assert script_folder([sys.executable, "-u", str(script), "--steps", "3"]) == str(tmp_path)
    assert script_folder([sys.executable, "-m", "elastic_runtime.cli.demo_multiprocess"]) is None
