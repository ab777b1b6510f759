"""Ray benchmark: a node removed mid-run, our recovery against Ray Train's answer, on one Ray test cluster.

    .venv/bin/python tests/benchmarks/bench_ray.py [--repeats 3] [--only elastic] [--json out.json]

``make chaos-ray`` runs the elastic policy alone ``ROUNDS`` times (default 5): a node removed in each run, every
run checked (it ends ok at the target, no committed step lost, every replica's final digest the same).

One local multi-node Ray cluster for the whole run (``elastic_runtime.cluster.controller.ray_cluster.local_cluster``: a
head without CPUs, where the controller runs beside the driver, and 4 one-CPU worker nodes, every process on
127.0.0.1). Each run: the demo model (runtime/cli/demo_multiprocess.py) as 3 workers x 2 CPU devices, one
Ray actor per node, 30 steps slowed to 0.3 s a step; once step 5 is committed, the node of worker 1 is removed
(``Cluster.remove_node``: its raylet and actor processes killed), and a fresh node is added after the run so
that the next one starts on 4 again. The two policies alternate, on the same cluster, in one invocation.

- **elastic** (``launch --backend ray``'s parts, ``min_nprocs`` 2): the survivors re-form in-process at once,
  Ray places a replacement with a new id on the free node, the group grows back.
- **ray-train policy** (emulated): what ``ray.train`` does with ``FailureConfig(max_failures=...)`` when a
  worker dies: the whole worker group is torn down and a new one (every actor and process new) restores
  the newest checkpoint from the run's storage and goes on. Emulated, not run: Ray Train 2.60's
  ``JaxTrainer`` initializes ``jax.distributed`` only for TPUs or GPUs (``_JaxBackend.on_start`` returns at
  once otherwise, ``ray/train/v2/jax/config.py``), so on CPUs its workers would not form one JAX job, and
  ``ray.train`` needs ``ray[train]`` (pandas, pyarrow, ...). The emulation: the same controller told to stop
  at the first failure (``max_failures=0``: every worker stopped, every actor killed), then a new controller
  resuming the run folder with 3 new actors, every worker's replicas in one folder on local disk (Ray
  Train's ``storage_path``), restored at the newest step there.

Times are from the node's removal (the events' ``mono_time``, the same clock): detection (the first
``WorkerLost``), the next committed step, and (elastic) the group back at 3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elastic_runtime.cli.demo_multiprocess import worker_command
from elastic_runtime.cluster import auth
from elastic_runtime.cluster.config import LaunchConfig, LaunchResult
from elastic_runtime.cluster.controller import Controller
from elastic_runtime.cluster.controller.ray_backend import RayPlacement
from elastic_runtime.cluster.controller.ray_cluster import add_node, local_cluster, ray_session
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupFormed, StepCompleted, WorkerLost
from elastic_runtime.defaults import ray_controller

NPROCS = 3
STEPS = 30
LOSE_AT = 5  # the node goes once the group committed this step
STEP_DELAY_S = 0.3
_WAIT_S = 120.0


def stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def _config(run_dir: Path, **extra: Any) -> LaunchConfig:
    return LaunchConfig(
        command=[],
        nprocs=NPROCS,
        target_steps=STEPS,
        run_dir=str(run_dir),
        secret=auth.new_secret(),
        listen_host="127.0.0.1",
        **extra,
    )


def _env(root: Path) -> dict[str, str]:
    return {"ELASTIC_STEP_DELAY_S": str(STEP_DELAY_S), "ELASTIC_COMPILE_CACHE": str(root / "xla-cache")}


@contextlib.contextmanager
def _running(controller: Controller, placement: RayPlacement) -> Iterator[dict[str, Any]]:
    """``controller.run()`` in a thread; the outcome (``result`` or ``error``) in the yielded dict once the
    block has joined it. Stops the actors on the way out."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = controller.run()
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="controller")
    thread.start()
    outcome["thread"] = thread
    try:
        yield outcome
        thread.join(_WAIT_S)
        assert not thread.is_alive(), "the run did not end in time"
    finally:
        placement.close()
        for path in Path("/dev/shm").glob(f"elastic-runtime-{controller.record.run_id}-*"):
            shutil.rmtree(path, ignore_errors=True)


def _wait_for(what: str, condition: Callable[[], bool], thread: threading.Thread) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not condition():
        assert thread.is_alive(), f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {_WAIT_S} s"
        time.sleep(0.05)


def _committed(run_dir: Path, step: int) -> bool:
    path = run_dir / "events.jsonl"
    return path.exists() and any(isinstance(e, StepCompleted) and e.step >= step for e in read_events(path))


def _lose_node_of(cluster: Any, placement: RayPlacement, worker: int) -> tuple[float, int]:
    """Remove the node of ``worker``; when, and the pid of its process (which outlives the simulated node)."""
    [node] = [n for n in cluster.worker_nodes if n.node_id == placement.placed[worker].node]
    orphan = placement.placed[worker].pid
    lost_at = time.monotonic()
    cluster.remove_node(node)
    return lost_at, orphan


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def elastic(cluster: Any, root: Path) -> dict[str, Any]:
    run_dir = root / "run"
    controller, placement = ray_controller(
        _config(run_dir, min_nprocs=NPROCS - 1), worker_command(STEPS), env=_env(root.parent)
    )
    with _running(controller, placement) as outcome:
        _wait_for(f"step {LOSE_AT}", lambda: _committed(run_dir, LOSE_AT), outcome["thread"])
        lost_at, orphan = _lose_node_of(cluster, placement, 1)
    _kill(orphan)  # told to exit by the controller already, normally
    for path in Path("/dev/shm").glob(f"elastic-runtime-{controller.record.run_id}-*"):  # what it wrote last
        shutil.rmtree(path, ignore_errors=True)
    result: LaunchResult = outcome["result"]
    assert result.ok and result.step == STEPS, result.reason  # not ok also when the replicas' digests differ
    assert all(r["lost_steps"] == 0 for r in result.recoveries), result.recoveries
    events = read_events(run_dir / "events.jsonl")
    [lost] = [e for e in events if isinstance(e, WorkerLost)]
    before = max(e.step for e in events if isinstance(e, StepCompleted) and e.mono_time < lost_at)
    next_commit = min(e.mono_time for e in events if isinstance(e, StepCompleted) and e.step == before + 1)
    # None when the replacement came too late: the group grows back only until 5 steps before the end.
    grown = next((e for e in events if isinstance(e, GroupFormed) and e.strategy == "grow"), None)
    return {
        "detected_by": lost.detected_by,
        "detected_after_s": lost.mono_time - lost_at,
        "next_commit_after_s": next_commit - lost_at,
        "grown_back_after_s": None if grown is None else grown.mono_time - lost_at,
        "lost_steps": sum(r["lost_steps"] for r in result.recoveries),
        "world_size_history": result.world_size_history,
        "survivor_restarts": result.survivor_restarts,
    }


def ray_train_policy(cluster: Any, root: Path) -> dict[str, Any]:
    run_dir, storage = root / "run", str(root / "storage")  # storage: local disk, every worker's replicas
    controller, placement = ray_controller(
        _config(run_dir, max_failures=0), worker_command(STEPS), env=_env(root.parent), replica_dir=storage
    )
    with _running(controller, placement) as outcome:
        _wait_for(f"step {LOSE_AT}", lambda: _committed(run_dir, LOSE_AT), outcome["thread"])
        lost_at, orphan = _lose_node_of(cluster, placement, 1)
    _kill(orphan)  # the lost node's leftover (a real lost host takes it along); every other actor was killed
    assert "error" in outcome, "the first attempt should stop at the failure"
    first = read_events(run_dir / "events.jsonl")
    [lost] = [e for e in first if isinstance(e, WorkerLost)]
    committed = max(e.step for e in first if isinstance(e, StepCompleted))
    restart_at = time.monotonic()
    controller, placement = ray_controller(
        _config(run_dir, resume=True), worker_command(STEPS), env=_env(root.parent), replica_dir=storage
    )
    with _running(controller, placement):
        pass
    events = [e for e in read_events(run_dir / "events.jsonl") if e.mono_time >= restart_at]
    result = controller.result
    assert result.ok and result.step == STEPS, result.reason
    restored = next(e.restore_step for e in events if isinstance(e, GroupFormed))  # the newest replica's step
    next_commit = min(e.mono_time for e in events if isinstance(e, StepCompleted) and e.step > restored)
    return {
        "detected_by": lost.detected_by,
        "detected_after_s": lost.mono_time - lost_at,
        "next_commit_after_s": next_commit - lost_at,
        "committed_before": committed,
        "restored_step": restored,
        "lost_steps": max(0, committed - restored),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each policy (default 3)")
    parser.add_argument("--only", choices=["elastic", "ray_train_policy"], default=None, help="one policy only")
    parser.add_argument(
        "--json", nargs="?", const="", default=None, metavar="PATH", help="also write the summary to PATH, if given"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    samples: dict[str, list[dict[str, Any]]] = {"elastic": [], "ray_train_policy": []}
    started = time.monotonic()
    with local_cluster(NPROCS + 1) as cluster, ray_session(cluster.address):
        cluster_up_s = time.monotonic() - started
        for i in range(args.repeats):
            for name, policy in (("elastic", elastic), ("ray_train_policy", ray_train_policy)):
                if args.only and name != args.only:
                    continue
                sample = policy(cluster, root / f"{name}-{i}")
                samples[name].append(sample)
                print(json.dumps({name: sample}, default=str), file=sys.stderr, flush=True)
                add_node(cluster)  # 4 worker nodes again for the next run
    summary: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cluster_up_s": round(cluster_up_s, 2),
        "seconds": round(time.monotonic() - started, 1),
    }
    for name, runs in samples.items():
        if not runs:
            continue
        summary[name] = {
            key: stats([float(r[key]) for r in runs if r[key] is not None])
            for key in ("detected_after_s", "next_commit_after_s", "grown_back_after_s", "lost_steps")
            if key in runs[0]
        }
        summary[name]["detected_by"] = sorted({r["detected_by"] for r in runs})
    if "elastic" in summary and "ray_train_policy" in summary:
        ours = summary["elastic"]["next_commit_after_s"]["median"]
        theirs = summary["ray_train_policy"]["next_commit_after_s"]["median"]
        summary["ratio_next_commit"] = round(theirs / ours, 2)
    print(json.dumps(summary))
    if args.json:  # the summary is stdout's last line anyway (what `make bench` reads)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
