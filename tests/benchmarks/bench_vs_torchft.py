"""Against TorchFT: the demo MLP on 3 workers, ``kill -9`` of one at step 20, in both systems. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_vs_torchft.py [--repeats 5] [--burners 2] [--json out.json]
    make bench-torchft        # builds .venv-torchft (constraints/torchft.txt), then runs this

The model and data of ``elastic-runtime demo --processes 3`` (runtime/cli/demo_multiprocess.py): an MLP
128 -> 512 (GELU) -> 1 learning a fixed teacher network, global batch 96, momentum SGD (lr 0.002, beta 0.9),
numpy-generated inputs, targets and initial weights; this file generates them again for TorchFT and checks
they equal elastic_runtime.testing.demo_model's.

- **ours**: the controller API as tests/benchmarks/bench_multiprocess.py uses it (3 worker processes x 2 CPU
  devices, gloo, one warm spare, every default); the controller sends ``kill -9`` to process 1 once step 20
  is committed. Timestamps from the run's event log.
- **TorchFT** (``torchft`` 0.2.0 on CPU ``torch``, in .venv-torchft): a Lighthouse (``min_replicas`` 2) and
  3 replica groups of one process each, a Manager on ``ProcessGroupGloo`` in each, one flat gradient buffer
  all-reduced per step. Each step's global batch of 96 is split over the replicas taking part in it, so a
  step at 2 of 3 replicas sees the same data as one at 3. This script sends ``kill -9`` to replica 1 once its
  log shows step 20 committed and starts a replacement at once as a new process (cold: it imports torch,
  starts its Manager, and heals from a peer), as a restarting scheduler would. Run at the Lighthouse's default
  heartbeat timeout (5 s) and at 1 s. Timestamps from the JSON lines each worker writes.

Measured in each run, in seconds from the kill: the first step committed by the group formed after it
(``next_commit``: a new generation for ours, a new quorum id for TorchFT), the first such step with all 3
workers taking part (``full_size``), steps committed before the kill and not kept (``lost_steps``), the final
state against a fault-free run of the same system (``exact``: bitwise; for TorchFT the largest absolute
difference too), and the median interval between committed steps 6 to 20 (``step_s``); for ours, the time from
the kill to the next commit by phase (``phases_s``: ``detect``, ``form``, the slowest member's own join phases
``join_*`` within it, ``restore_and_step``; medians in the summary). The three contenders
run interleaved ``--repeats`` times, each beside ``--burners`` busy processes (none by default) that spin at
the same priority for the run's whole length; the last line printed is a JSON summary with medians and ranges.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

NPROCS = 3
VICTIM = 1
KILL_AT = 20
FEATURES = 128
HIDDEN = 512
GLOBAL_BATCH = 96
TEACHER_HIDDEN = 32
LR = 0.002
BETA = 0.9
SEED = 0
# ours: a fixed length (the group re-forms at full size with the spare); TorchFT: at least this long, and
# then until FULL_TAIL steps in a row have had all 3 replicas (the replacement can take longer than 40 steps).
STEPS = 60
FULL_TAIL = 10
RUN_TIMEOUT_S = 300.0
CONTENDERS = ("ours", "torchft_default", "torchft_1s")
HEARTBEAT_MS = {"torchft_default": None, "torchft_1s": 1000}


# --- the demo's model and data, in numpy (both systems) -------------------------------------------------------


def teacher_batch(position: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch at ``position``: elastic_runtime.testing.demo_model.TeacherData's, for the demo's sizes."""
    teacher = np.random.default_rng([SEED, 2**31 - 1])
    w = teacher.standard_normal((FEATURES, TEACHER_HIDDEN)).astype(np.float32) / np.sqrt(FEATURES)
    v = teacher.standard_normal((TEACHER_HIDDEN, 1)).astype(np.float32) / np.sqrt(TEACHER_HIDDEN)
    rng = np.random.default_rng([SEED, position])
    x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
    return x, (np.tanh(x @ w) @ v).astype(np.float32)


def initial_params() -> dict[str, np.ndarray]:
    """elastic_runtime.testing.demo_model.init_state's parameters (momentum starts at zero)."""
    rng = np.random.default_rng(SEED)
    return {
        "w1": (rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32),
        "b1": np.zeros((HIDDEN,), np.float32),
        "w2": (rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
    }


def check_same_data() -> None:
    """Fails unless this file's data and initial weights are the demo's, bit for bit."""
    from elastic_runtime.testing.demo_model import TeacherData, init_state

    ours = TeacherData(global_batch=GLOBAL_BATCH, features=FEATURES, seed=SEED)
    for position in (0, 1, KILL_AT, 1000):
        x, y = teacher_batch(position)
        batch = ours.batch(position)
        assert np.array_equal(x, batch["x"]) and np.array_equal(y, batch["y"]), f"batch {position} differs"
    state = init_state(FEATURES, HIDDEN, SEED)
    for name, value in initial_params().items():
        assert np.array_equal(value, state["params"][name]), f"initial {name} differs"


# --- small helpers --------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, Any]:
    """Median and range, rounded; ``n`` counts the runs that reached the point measured."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_lines(path: Path) -> list[dict[str, Any]]:
    """A worker's JSON lines; a last line cut off by ``kill -9`` is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def median_interval(times: list[float]) -> float:
    return statistics.median(b - a for a, b in itertools.pairwise(times))


# --- ours -----------------------------------------------------------------------------------------------------


def run_ours(run_dir: Path, *, kill: bool) -> dict[str, Any]:
    """One run of the demo group through the controller; measured from its event log."""
    from elastic_runtime.cli.demo_multiprocess import run_group
    from elastic_runtime.core.eventlog import read_events
    from elastic_runtime.core.events import GroupFormed, StepCompleted, WorkerExited, WorkerKilled, WorkerLost
    from elastic_runtime.faults.grammar import Fault

    faults = [Fault("kill", VICTIM, step=KILL_AT)] if kill else []
    result = run_group(processes=NPROCS, steps=STEPS, run_dir=run_dir, faults=faults)
    events = read_events(run_dir / "events.jsonl")
    commits: dict[int, float] = {}
    for event in events:
        if isinstance(event, StepCompleted) and event.step is not None:
            commits.setdefault(event.step, event.wall_time)
    steady = [commits[s] for s in range(6, KILL_AT + 1) if s in commits]
    run: dict[str, Any] = {"ok": bool(result.ok), "final_step": result.step, "step_s": median_interval(steady)}
    if not kill:
        return run
    killed = next(e for e in events if isinstance(e, WorkerKilled))
    formed = [e for e in events if isinstance(e, GroupFormed) and e.wall_time > killed.wall_time]
    next_commit = full_size = None
    phases: dict[str, float] = {}
    if formed:
        after = sorted(t for t in commits.values() if t > formed[0].wall_time)
        next_commit = after[0] - killed.wall_time if after else None
        # From the kill to the next commit: seen (the exit or the silence), the group formed (and the slowest
        # member's join by its own phases), the restore and the first step.
        seen = next(e for e in events if isinstance(e, WorkerExited | WorkerLost) and e.wall_time >= killed.wall_time)
        phases = {"detect": seen.wall_time - killed.wall_time, "form": formed[0].wall_time - seen.wall_time}
        phases |= {f"join_{name}": seconds for name, seconds in formed[0].phases.items()}
        if after:
            phases["restore_and_step"] = after[0] - formed[0].wall_time
        full = [e for e in formed if len(e.members) == NPROCS]
        if full:
            after_full = sorted(t for t in commits.values() if t > full[0].wall_time)
            full_size = after_full[0] - killed.wall_time if after_full else None
    run |= {
        "next_commit_s": next_commit,
        "full_size_s": full_size,
        "lost_steps": sum(r["lost_steps"] for r in result.recoveries),
        "world_size_history": result.world_size_history,
        "phases_s": {name: round(seconds, 4) for name, seconds in phases.items()},
    }
    return run


def ours_exact(run_dir: Path, reference_dir: Path) -> bool:
    from elastic_runtime.core.compare import compare_states
    from elastic_runtime.storage.disk import DiskTier

    got, want = (DiskTier(path / "final").latest(None).tree for path in (run_dir, reference_dir))
    return bool(compare_states(got, want, bitwise=True)["match"])


# --- TorchFT: the workers (run by .venv-torchft's Python) -----------------------------------------------------


def torchft_worker(args: argparse.Namespace) -> None:
    """One replica group of one process: the demo's step under a TorchFT Manager, logging every commit."""
    started = time.time()
    out = Path(args.out)
    log = open(out / f"replica-{args.replica}.jsonl", "a", buffering=1)  # noqa: SIM115 (open for the whole run)

    def note(**record: Any) -> None:
        log.write(json.dumps({"t": time.time(), "pid": os.getpid()} | record) + "\n")

    note(e="start", t=started)
    import torch
    import torch.nn.functional as functional
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    note(e="imported")
    # 3 workers on 2 cores: more threads a worker would only contend (our workers are 2 XLA devices each).
    torch.set_num_threads(1)
    params = {name: torch.tensor(value, requires_grad=True) for name, value in initial_params().items()}
    optimizer = torch.optim.SGD(params.values(), lr=LR, momentum=BETA)

    def state_dict() -> dict[str, Any]:
        return {"params": {k: v.detach().clone() for k, v in params.items()}, "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, value in state["params"].items():
                params[name].copy_(value)
        optimizer.load_state_dict(state["optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica}",
        hostname="127.0.0.1",
    )
    note(e="ready")
    if not args.replacement:  # the first 3 start together, as a job's first launch does
        (out / f"ready-{args.replica}").touch()
        while not all((out / f"ready-{i}").exists() for i in range(NPROCS)):
            time.sleep(0.01)
    save_at = {int(s) for s in args.save_at.split(",") if s}
    full_run = 0
    while True:
        manager.start_quorum()
        rank = manager.participating_rank()
        participants = manager.num_participants()
        step = manager.current_step()
        x, y = teacher_batch(step)
        rows = GLOBAL_BATCH // participants
        # A healing replica (rank None) takes no part: TorchFT zeroes its gradient before the all-reduce.
        mine = slice((rank or 0) * rows, ((rank or 0) + 1) * rows)
        optimizer.zero_grad()
        # jax.nn.gelu's default is the tanh approximation.
        hidden = functional.gelu(torch.from_numpy(x[mine]) @ params["w1"] + params["b1"], approximate="tanh")
        loss = torch.mean((hidden @ params["w2"] - torch.from_numpy(y[mine])) ** 2)
        loss.backward()
        grads = [p.grad for p in params.values() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        if not manager.should_commit():
            note(e="abort", step=step)
            continue
        optimizer.step()
        committed = manager.current_step()
        note(e="commit", step=committed, n=participants, quorum=manager._quorum_id)
        full_run = full_run + 1 if participants == NPROCS else 0
        # Every replica sees the same step and participants, so all three stop after the same step.
        last = committed >= args.min_steps and full_run >= FULL_TAIL
        if last or committed in save_at:
            arrays = {k: v.detach().numpy() for k, v in params.items()}
            np.savez(out / f"params-{args.replica}-{committed}.npz", **arrays)
        if last:
            break
    note(e="done", step=committed)
    manager.shutdown(wait=False)
    log.close()


# --- TorchFT: one run (this side runs in .venv, without torch) ------------------------------------------------


def run_torchft(
    run_dir: Path, python: str, *, heartbeat_ms: int | None, kill: bool, min_steps: int = STEPS, save_at: str = ""
) -> dict[str, Any]:
    """A Lighthouse and 3 replicas; with ``kill``, replica 1 gets ``kill -9`` at step 20 and a cold replacement."""
    run_dir.mkdir(parents=True)
    port = free_port()
    lighthouse_command = [
        str(Path(python).parent / "torchft_lighthouse"),
        "--min_replicas",
        "2",
        "--bind",
        f"127.0.0.1:{port}",
    ]
    if heartbeat_ms is not None:
        lighthouse_command += ["--heartbeat_timeout_ms", str(heartbeat_ms)]
    env = os.environ | {"RUST_LOG": "info"}
    output = open(run_dir / "output.log", "wb")  # noqa: SIM115 (shared by every process of the run)

    def start(replica: int, replacement: bool = False) -> subprocess.Popen[bytes]:
        command = [python, __file__, "--torchft-worker", "--replica", str(replica), "--out", str(run_dir)]
        command += ["--lighthouse", f"http://127.0.0.1:{port}", "--min-steps", str(min_steps), "--save-at", save_at]
        return subprocess.Popen(
            [*command, *(["--replacement"] if replacement else [])], stdout=output, stderr=output, env=env
        )

    lighthouse = subprocess.Popen(lighthouse_command, stdout=output, stderr=output, env=env)
    workers = [start(i) for i in range(NPROCS)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    kill_time = None
    try:
        if kill:
            victim_log = run_dir / f"replica-{VICTIM}.jsonl"
            while kill_time is None and time.monotonic() < deadline:
                if any(r.get("e") == "commit" and r["step"] >= KILL_AT for r in read_lines(victim_log)):
                    kill_time = time.time()
                    workers[VICTIM].send_signal(signal.SIGKILL)
                    workers.append(start(VICTIM, replacement=True))
                else:
                    time.sleep(0.002)
        for worker in workers:
            worker.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in [*workers, lighthouse]:
            if process.poll() is None:
                process.kill()
                process.wait()
        output.close()
    return torchft_measures(run_dir, kill_time, [w.returncode for w in workers])


def torchft_measures(run_dir: Path, kill_time: float | None, returncodes: list[int | None]) -> dict[str, Any]:
    records = {i: read_lines(run_dir / f"replica-{i}.jsonl") for i in range(NPROCS)}
    commits = [r for rs in records.values() for r in rs if r.get("e") == "commit"]
    steady = [r["t"] for r in records[0] if r.get("e") == "commit" and 6 <= r["step"] <= KILL_AT]
    finals = sorted(run_dir.glob("params-0-*.npz"))
    final_step = max((int(p.stem.rsplit("-", 1)[1]) for p in finals), default=None)
    # The killed replica's exit code is -9; every other process must have finished its run.
    survivors = [code for i, code in enumerate(returncodes) if i != VICTIM or kill_time is None]
    run: dict[str, Any] = {
        "ok": all(code == 0 for code in survivors) and final_step is not None,
        "final_step": final_step,
        "step_s": median_interval(steady),
    }
    if kill_time is None:
        return run
    before = [r for r in commits if r["t"] <= kill_time]
    old_quorum = max(before, key=lambda r: r["t"])["quorum"]
    after = sorted((r for r in commits if r["t"] > kill_time and r["quorum"] != old_quorum), key=lambda r: r["t"])
    full = [r for r in after if r["n"] == NPROCS]
    # Steps committed (in the old quorum, by anyone) before the new group's first commit and not kept by it.
    last_before = max(r["step"] for r in commits if not after or r["t"] < after[0]["t"])
    run |= {
        "next_commit_s": after[0]["t"] - kill_time if after else None,
        "next_commit_participants": after[0]["n"] if after else None,
        "full_size_s": full[0]["t"] - kill_time if full else None,
        "lost_steps": max(0, last_before - (after[0]["step"] - 1)) if after else None,
        "degraded_steps": len({r["step"] for r in after if r["n"] < NPROCS}),
        # The cold replacement: torch and torchft imported, then its Manager up (and heartbeating).
        "replacement_imported_s": replacement_time(records[VICTIM], "imported", kill_time),
        "replacement_ready_s": replacement_time(records[VICTIM], "ready", kill_time),
    }
    # The three final states must agree with each other before one is compared with the fault-free run.
    if final_step is not None:
        states = [np.load(run_dir / f"params-{i}-{final_step}.npz") for i in range(NPROCS)]
        run["replicas_agree"] = all(np.array_equal(states[0][k], s[k]) for s in states[1:] for k in ("w1", "b1", "w2"))
    return run


def replacement_time(records: list[dict[str, Any]], event: str, kill_time: float) -> float | None:
    return next((r["t"] - kill_time for r in records if r.get("e") == event and r["t"] > kill_time), None)


def torchft_difference(run_dir: Path, reference_dir: Path, step: int) -> float:
    got = np.load(run_dir / f"params-0-{step}.npz")
    want = np.load(reference_dir / f"params-0-{step}.npz")
    return max(float(np.max(np.abs(got[k] - want[k]))) for k in ("w1", "b1", "w2"))


# --- the benchmark --------------------------------------------------------------------------------------------


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        for key in ("next_commit_s", "full_size_s", "step_s"):
            figures = spread([r[key] for r in results if r.get(key) is not None])
            for stat in ("median", "min", "max"):
                summary[f"{name}_{key.removesuffix('_s')}_s_{stat}"] = figures[stat]
            summary[f"{name}_{key.removesuffix('_s')}_n"] = figures["n"]
        summary[f"{name}_lost_steps"] = [r.get("lost_steps") for r in results]
        summary[f"{name}_exact"] = [r.get("exact") for r in results]
        if name != "ours":
            summary[f"{name}_max_abs_diff"] = [r.get("max_abs_diff") for r in results]
            summary[f"{name}_next_commit_participants"] = [r.get("next_commit_participants") for r in results]
            summary[f"{name}_degraded_steps"] = [r.get("degraded_steps") for r in results]
    ours_phases = [r["phases_s"] for r in runs.get("ours", []) if r.get("phases_s")]
    for phase in sorted({name for phases in ours_phases for name in phases}):
        summary[f"ours_phase_{phase}_s_median"] = spread([p[phase] for p in ours_phases if phase in p])["median"]
    for name in runs.keys() - {"ours"} if "ours" in runs else ():
        for key in ("next_commit", "full_size", "step"):
            theirs, ours = summary[f"{name}_{key}_s_median"], summary[f"ours_{key}_s_median"]
            summary[f"ratio_{name}_over_ours_{key}"] = round(theirs / ours, 2) if theirs and ours else None
    return summary


@contextlib.contextmanager
def burning(burners: int) -> Iterator[None]:
    """``burners`` processes spinning at the same priority for as long as the block runs (a loaded host)."""
    stop = multiprocessing.Event()
    spinning = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(burners)]
    for process in spinning:
        process.start()
    try:
        yield
    finally:
        stop.set()
        for process in spinning:
            process.join(timeout=10)


def _burn(stop: Any) -> None:
    while not stop.is_set():
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each contender, interleaved")
    parser.add_argument("--burners", type=int, default=0, help="busy processes beside each measured run")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--torchft-python", default=".venv-torchft/bin/python", help="a Python with torchft")
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    # The TorchFT workers' entry point (this file, run by --torchft-python).
    parser.add_argument("--torchft-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--min-steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--save-at", default="", help=argparse.SUPPRESS)
    parser.add_argument("--replacement", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchft_worker:
        torchft_worker(args)
        return 0

    python = str(Path(args.torchft_python).absolute())
    if any(name != "ours" for name in args.only) and not Path(python).exists():
        parser.error(f"no TorchFT Python at {python}: `make bench-torchft` builds .venv-torchft")
    check_same_data()
    root = Path(tempfile.mkdtemp(prefix="bench-torchft-"))
    started = time.time()
    results: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "load_before": load_average(),
        "burners": args.burners,
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.only}
    try:
        if "ours" in runs:
            reference = run_ours(root / "ours-reference", kill=False)
            assert reference["ok"], "ours: the fault-free reference run failed"
        for repeat in range(args.repeats):
            for name in args.only:
                load = load_average()
                run_dir = root / f"{name}-{repeat}"
                with burning(args.burners):
                    if name == "ours":
                        run = run_ours(run_dir, kill=True)
                    else:
                        run = run_torchft(run_dir, python, heartbeat_ms=HEARTBEAT_MS[name], kill=True)
                if name == "ours":
                    run["exact"] = ours_exact(run_dir, root / "ours-reference") if run["ok"] else None
                run |= {"contender": name, "repeat": repeat, "load_before": load, "load_after": load_average()}
                run["burners"] = args.burners
                runs[name].append(run)
                print(json.dumps(run, default=str), flush=True)
        torchft_steps = sorted({r["final_step"] for n, rs in runs.items() if n != "ours" for r in rs if r["ok"]})
        if torchft_steps:
            reference_dir = root / "torchft-reference"
            run_torchft(
                reference_dir,
                python,
                heartbeat_ms=None,
                kill=False,
                min_steps=max(torchft_steps),
                save_at=",".join(map(str, torchft_steps)),
            )
            for name in runs.keys() - {"ours"}:
                for run in runs[name]:
                    if run["ok"]:
                        run["max_abs_diff"] = torchft_difference(
                            root / f"{name}-{run['repeat']}", reference_dir, run["final_step"]
                        )
                        run["exact"] = run["max_abs_diff"] == 0.0
        shutil.rmtree(root, ignore_errors=True)
    except BaseException:
        print(f"failed; run directories kept under {root}", file=sys.stderr)
        raise
    results |= {"runs": runs, "load_after": load_average(), "seconds": round(time.time() - started, 1)}
    results |= summarize(runs)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
