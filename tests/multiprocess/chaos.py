"""Chaos loop for the multi-process mode (``make chaos``; not collected by pytest).

Each round kills real worker processes at random steps with random signals (kill -9 or SIGSTOP), sometimes
a second one while the group re-forms, sometimes from inside a worker mid-step or mid-replica-write, or
deadlocks a worker's step, or has a local process without the run's secret try to take the run over (an
impostor ``Hello``, a forged ``Heartbeat(step=600)`` and ``Finished`` for every id, with a kill on top; or
300 idle connections and a flood of malformed lines), and checks the final state against a fault-free run
(bitwise: every recovery keeps the full world size), the event log for lost committed steps, and that the
attacker was only ever sent the handshake's challenge. Three cases act on the controller or on the job: a
crash that repeats at the same step in every attempt (the run must end within the retry budget with the
worker's error), ``kill -9`` of the controller then ``launch --resume`` (bitwise again, no worker left
behind), SIGTERM to the controller (``RunFinished``, ``summary.json``, no /dev/shm folder, no process
left), and SIGTERM with a durable tier (``sigterm-durable``: a durable checkpoint of the newest step committed
in the drain, then ``--resume`` from it: no step completed twice, bitwise). Correlated losses (``together``: two
workers killed at the same instant with one warm spare; ``during-recovery``: a second kill while the group
re-forms) are judged on "no survivor killed" and "one re-form" too. ``leave``: a worker SIGTERMed by its host
(``term``), a planned departure: no loss, no kill, no recovery; ``leave-killed``: the same worker then killed
0.1 s later, before the step it was to leave at (a grace period cut short), judged as a correlated loss.
``slow``: a worker 3x slower from a step (a straggler), replaced at a planned step or kept, judged like ``leave``.
``during-restore``: a second kill while the re-formed group restores; ``durable-write``: a kill right after a
durable step's commit, when its checkpoint's write starts (every 5 steps, to a folder).
``corrupt`` and ``corrupt-persistent``: a bit of one worker's copy of the state flipped once (healed by the
members' replay: no recovery) or before every step (that worker alone replaced: the majority of the 3 slices
names it), bitwise either way.

    .venv/bin/python tests/multiprocess/chaos.py --rounds 10 [--seed 1] [--cases resume,sigterm,repeat]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import jax
import numpy as np
from attacker import run_under_attack

from elastic_runtime.cli.demo_multiprocess import group_controller, run_group, worker_command
from elastic_runtime.cluster.config import LaunchConfig
from elastic_runtime.cluster.controller.runfolder import default_replica_dir
from elastic_runtime.cluster.protocol import ENV_STEP_DELAY_S
from elastic_runtime.core.errors import RecoveryError
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import (
    CorruptionHealed,
    GroupFormed,
    RunFinished,
    SilentCorruption,
    StateRestored,
    StepCompleted,
    WorkerKilled,
    WorkerLost,
    WorkerSignalled,
)
from elastic_runtime.faults.grammar import Fault
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.testing import launched

NPROCS = 3
STEPS = 40
# A replica file every this many steps (the default where every process holds the whole state): when every
# process is lost at once (the controller killed, or every worker crashing) the run goes back up to one less.
FILE_EVERY = LaunchConfig(command=["python"], nprocs=NPROCS).replica_file_every


# Cases that act on the controller or the job rather than on one worker: run by ``controller_round``.
CONTROLLER_CASES = ("repeat", "resume", "sigterm", "sigterm-durable")
# Cases whose losses come together: judged on "no survivor killed" and "one re-form" too.
CORRELATED_CASES = ("together", "during-recovery", "leave-killed")


CASES = (
    "kill",
    "kill",
    "stop",
    "two",
    "together",
    "during-recovery",
    "midstep",
    "replica",
    "hang",
    "impostor",
    "flood",
    "leave",
    "leave-killed",
    "slow",
    "corrupt",
    "corrupt-persistent",
    "during-restore",
    "durable-write",
    *CONTROLLER_CASES,
)


def plan(rng: random.Random, cases: tuple[str, ...] = CASES) -> dict[str, Any]:
    kind = rng.choice(cases)
    step = rng.randrange(3, STEPS - 8)
    pid = rng.randrange(NPROCS)
    match kind:
        case "repeat":
            # Every process crashes at the step: before the first replica file, the run ends with nothing to
            # restore ("no member holds any step"), not with the repeated crash.
            return {"case": kind, "step": max(step, FILE_EVERY + 3)}
        case "resume" | "sigterm" | "sigterm-durable":
            return {"case": kind, "step": step}
        case "together":
            other = rng.choice([p for p in range(NPROCS) if p != pid])
            return {"faults": [Fault("kill", pid, step=step), Fault("kill", other, step=step)], "correlated": True}
        case "kill":
            return {"faults": [Fault("kill", pid, step=step)]}
        case "stop":
            return {"faults": [Fault("stop", pid, step=step)]}
        case "two":
            return {
                "faults": [
                    Fault("kill", pid, step=step),
                    Fault("kill", rng.randrange(NPROCS), step=step + rng.randrange(1, 6)),
                ]
            }
        case "during-recovery":
            faults = [Fault("kill", pid, step=step), Fault("kill", rng.randrange(NPROCS), forming=True)]
            return {"faults": faults, "correlated": True}
        case "midstep":
            return {"faults": [Fault("die-midstep", pid, step=step)]}
        case "hang":
            return {"faults": [Fault("hang", pid, step=step)], "hang_timeout_s": 2.0}
        case "impostor":
            return {"faults": [Fault("kill", pid, step=step)], "attack": "impostor"}
        case "flood":
            return {"faults": [], "attack": "flood"}
        case "leave":
            return {"faults": [Fault("term", pid, step=step)], "planned": True}
        case "leave-killed":
            return {"faults": [Fault("term", pid, step=step)], "correlated": True, "kill_leaver": True}
        case "slow":
            # A straggler (3x from the step), its steps long enough to be told from noise (0.1 s more each, every
            # worker): replaced by the spare at a planned step (the strategies say "drain"), or kept near the
            # run's end; either way nothing is lost, killed or counted.
            delay = {"extra_env": {ENV_STEP_DELAY_S: "0.1"}}
            return {"faults": [Fault("slow", pid, step=min(step, STEPS // 3), factor=3.0)], "planned": True} | delay
        case "during-restore":
            # A second kill once the group re-formed, while its members restore the step.
            return {"faults": [Fault("kill", pid, step=step), Fault("kill", rng.randrange(NPROCS), restoring=True)]}
        case "durable-write":
            # A durable checkpoint every 5 steps; the kill right after a due step's commit, its write under way.
            at = 5 * rng.randrange(1, STEPS // 5 - 1)
            return {"faults": [Fault("kill", pid, step=at)], "durable_every": 5, "durable": True}
        case "corrupt" | "corrupt-persistent":
            # Silent: a bit of its copy flipped (once, or before every step), found by the slices' comparison.
            command = worker_command(STEPS, fingerprint=True)
            return {"faults": [Fault(kind, pid, step=step)], "command": command, "corrupted": kind}
        case _:
            return {"faults": [Fault("die-writing-replica", pid, step=step)]}


def controller_round(case: str, step: int, run_dir: Path, reference: Path) -> list[str]:
    """One of ``CONTROLLER_CASES`` at ``step``; returns what went wrong."""
    if case == "repeat":
        script = Path(__file__).with_name("faulty_train.py")
        command = [sys.executable, str(script), "--steps", str(STEPS), "--crash-at", str(step)]
        try:
            run_group(processes=NPROCS, steps=STEPS, run_dir=run_dir, faults=[], command=command)
        except RecoveryError as exc:
            wanted = (f"step {step} failed 3 times", "corrupt record")
            return [f"RecoveryError without {w!r}: {exc}" for w in wanted if w not in str(exc)]
        return ["a crash repeating at every attempt did not end the run"]
    durable = ("--durable", str(run_dir.with_name(f"{run_dir.name}-durable")), "--durable-every", "1000")
    durable += ("--grace-s", "120")  # a hang guard: a loaded machine may take a while
    flags = durable if case == "sigterm-durable" else ()
    controller = launched.launch(run_dir, worker_command(STEPS), *flags, nprocs=NPROCS, step_delay_s=0.1)
    launched.wait_for_step(run_dir, controller, step)
    pids = launched.worker_pids(run_dir)
    problems: list[str] = []
    if case == "sigterm-durable":
        controller.send_signal(signal.SIGTERM)
        output, _ = controller.communicate(timeout=180)  # past the drain's grace (120 s): its report, not ours
        first = json.loads(output.decode().strip().splitlines()[-1])
        held = first.get("drain_checkpoint", -1)
        if held < step:
            problems.append(f"no durable checkpoint of the newest step in the drain: {first.get('reason')}")
        again = launched.launch(run_dir, worker_command(STEPS), *flags, "--resume", nprocs=NPROCS)
        output, _ = again.communicate(timeout=300)
        result = json.loads(output.decode().strip().splitlines()[-1]) if again.returncode == 0 else {}
        steps = [e.step for e in read_events(run_dir / "events.jsonl") if isinstance(e, StepCompleted)]
        if not result.get("ok") or result.get("resumed_from") != held:
            problems.append(f"resume from {held}: {result or output.decode()[-500:]}")
        elif len(steps) != len(set(steps)):
            problems.append(f"steps completed twice: {sorted(s for s in set(steps) if steps.count(s) > 1)}")
        else:
            problems += check(run_dir, reference)
    elif case == "sigterm":
        controller.send_signal(signal.SIGTERM)
        controller.communicate(timeout=120)
        last = read_events(run_dir / "events.jsonl")[-1]
        if not (isinstance(last, RunFinished) and "SIGTERM" in last.reason):
            problems.append(f"last event {last!r}")
        if json.loads((run_dir / "summary.json").read_text())["ok"] is not False:
            problems.append("summary.json says ok")
    else:  # resume
        os.kill(pids[step % len(pids)], signal.SIGSTOP)  # a stopped worker must not outlive its controller
        controller.kill()
        controller.communicate()
        problems += [f"worker {pid} outlived its controller" for pid in launched.wait_until_gone(pids)]
        again = launched.launch(run_dir, worker_command(STEPS), "--resume", nprocs=NPROCS)
        output, _ = again.communicate(timeout=300)
        result = json.loads(output.decode().strip().splitlines()[-1]) if again.returncode == 0 else {}
        resumed_from = max(result.get("resumed_from", -1), 0)  # -1: nothing held, started from the beginning
        if not result.get("ok") or resumed_from <= step - FILE_EVERY:
            problems.append(f"resume: {result or output.decode()[-500:]}")
        else:
            problems += check(run_dir, reference)
    if Path(default_replica_dir(run_dir)).exists():
        problems.append("the /dev/shm replica folder was left behind")
    problems += [f"process {pid} left behind" for pid in launched.wait_until_gone(launched.worker_pids(run_dir))]
    return problems


def check(run_dir: Path, reference: Path) -> list[str]:
    problems = []
    got, want = (jax.tree.leaves(DiskTier(folder).latest(None).tree) for folder in (run_dir / "final", reference))
    problems += [
        f"leaf {i} differs" for i, (a, b) in enumerate(zip(got, want, strict=True)) if not np.array_equal(a, b)
    ]
    committed = 0
    for event in read_events(run_dir / "events.jsonl"):
        if isinstance(event, StepCompleted):
            committed = max(committed, event.step or 0)
        elif isinstance(event, StateRestored):
            if (event.step or 0) < committed:
                problems.append(f"restored {event.step} after committing {committed}")
            committed = event.step or 0
    return problems


def false_alarms(run_dir: Path, spec: dict[str, Any]) -> list[str]:
    """Workers found lost by their silence though no fault silenced them: on one machine only a ``stop``
    (SIGSTOP) does; a kill closes the connection, a hang keeps the heartbeats going."""
    stopped = sum(fault.action == "stop" for fault in spec.get("faults", []))
    events = read_events(run_dir / "events.jsonl")
    silent = [e for e in events if isinstance(e, WorkerLost) and e.message.startswith("no heartbeat")]
    return [f"false alarm: worker {e.worker} lost after {e.silent_s:.2f} s of silence" for e in silent[stopped:]]


def correlated(run_dir: Path, result: Any) -> list[str]:
    """Losses that came together: no survivor killed or restarted, and one re-form for them."""
    events = read_events(run_dir / "events.jsonl")
    killed = [e for e in events if isinstance(e, WorkerKilled)]
    # A worker a fault killed may be killed again by its WorkerLost handler, if its connection closed before
    # its exit was seen: that is no survivor.
    victims = {e.worker for e in killed if e.reason.startswith("fault injection")}
    problems = [f"worker {e.worker} killed: {e.reason}" for e in killed if e.worker not in victims]
    if result.survivor_restarts:
        problems.append(f"{result.survivor_restarts} survivors restarted")
    formed = [e.generation for e in events if isinstance(e, GroupFormed)]
    if len(formed) != 2:
        problems.append(f"{len(formed) - 1} re-forms for one correlated loss (generations {formed})")
    return problems


def healed(run_dir: Path, result: Any, kind: str) -> list[str]:
    """A corruption found at the step after it (3 slices: the majority names its worker) and healed: a flipped bit
    by the replay, with no recovery; one at every step by replacing that worker alone."""
    events = read_events(run_dir / "events.jsonl")
    found = [e for e in events if isinstance(e, SilentCorruption)]
    cured = [e.kind for e in events if isinstance(e, CorruptionHealed)]
    if not found or not found[0].attributed:
        return [f"not found, or not attributed to one worker: {found}"]
    if kind == "corrupt" and (cured != ["transient"] or result.recoveries):
        return [f"a flipped bit healed as {cured}, with {len(result.recoveries)} recoveries"]
    killed = {e.worker for e in events if isinstance(e, WorkerKilled)}
    if kind == "corrupt-persistent" and (cured != ["persistent"] or killed != set(found[-1].workers)):
        return [f"a worker computing wrong healed as {cured}, killed {killed}, suspected {found[-1].workers}"]
    return []


def planned(run_dir: Path, result: Any) -> list[str]:
    """A worker SIGTERMed by its host leaves at a planned step: nothing lost, killed or counted as a failure."""
    events = read_events(run_dir / "events.jsonl")
    problems = [f"worker {e.worker} lost" for e in events if isinstance(e, WorkerLost)]
    kills = [e for e in events if isinstance(e, WorkerKilled) and "fault injection" not in e.reason]  # not the TERM
    problems += [f"worker {e.worker} killed: {e.reason}" for e in kills]
    if result.recoveries:
        problems.append(f"{len(result.recoveries)} recoveries for a planned departure")
    return problems


async def killed_before_its_step(event: WorkerSignalled, ctx: Any) -> None:
    """A grace period cut short: the worker that asked to leave is killed before the step it was to leave at."""
    await anyio.sleep(0.1)
    ctx.signal(event.worker, "KILL", "fault injection: the leaver killed before its planned step")


def run_round(run_dir: Path, spec: dict[str, Any]) -> tuple[Any, list[str]]:
    """One round; with an ``attack``, what the attacker got through is a problem too; with ``correlated``, a
    survivor killed or more than one re-form; with ``planned``, any loss, kill or recovery."""
    attack = spec.pop("attack", None)
    if spec.pop("durable", False):
        spec["durable_dir"] = str(run_dir.with_name(f"{run_dir.name}-durable"))
    corrupted = spec.pop("corrupted", None)
    if corrupted is not None:
        result = group_controller(processes=NPROCS, steps=STEPS, run_dir=run_dir, **spec).run()
        return result, healed(run_dir, result, corrupted)
    if spec.pop("planned", False):
        result = group_controller(processes=NPROCS, steps=STEPS, run_dir=run_dir, **spec).run()
        return result, planned(run_dir, result)
    kill_leaver = spec.pop("kill_leaver", False)
    if spec.pop("correlated", False):
        controller = group_controller(processes=NPROCS, steps=STEPS, run_dir=run_dir, **spec)
        if kill_leaver:
            controller.bus.subscribe(WorkerSignalled, killed_before_its_step)
        result = controller.run()
        return result, correlated(run_dir, result)
    controller = group_controller(processes=NPROCS, steps=STEPS, run_dir=run_dir, **spec)
    if attack is None:
        return controller.run(), []
    if attack == "impostor":
        result, attacker = run_under_attack(controller, lambda a, stop: a.impostors(NPROCS + 1, stop))
    else:
        result, attacker = run_under_attack(controller, lambda a, stop: (a.idle(300), a.malformed_flood(1000)))
    return result, attacker.problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--cases", default=",".join(dict.fromkeys(CASES)), help="comma-separated cases to draw from")
    args = parser.parse_args()
    cases = tuple(args.cases.split(","))
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="chaos-mp-"))
    print(f"chaos: {args.rounds} rounds, seed {args.seed}", flush=True)
    failures = 0
    longest_gap_s = 0.0  # the longest silence of a training worker in any round: the heartbeat timeout's margin
    try:
        reference = run_group(processes=NPROCS, steps=STEPS, run_dir=root / "reference", faults=[])
        assert reference.ok
        for i in range(args.rounds):
            spec = plan(rng, cases)
            run_dir = root / f"round-{i}"
            started = time.monotonic()
            try:
                if "case" in spec:
                    result = None
                    problems = controller_round(spec["case"], spec["step"], run_dir, root / "reference" / "final")
                else:
                    result, problems = run_round(run_dir, dict(spec))
                    problems += [] if result.ok else [f"run failed: {result.reason}"]
                    problems += check(run_dir, root / "reference" / "final")
                    problems += false_alarms(run_dir, spec)
                    longest_gap_s = max(longest_gap_s, result.longest_training_heartbeat_gap_s)
            except Exception as exc:
                problems = [f"{type(exc).__name__}: {exc}"]
                result = None
            failures += bool(problems)
            summary = ""
            if result is not None:
                summary = f"{result.strategies} recoveries={len(result.recoveries)}"
                summary += f" longest training silence {result.longest_training_heartbeat_gap_s} s"
            verdict = "FAIL " + "; ".join(problems) if problems else "ok"
            print(f"round {i}: {spec} {summary} {time.monotonic() - started:.1f} s: {verdict}", flush=True)
            if not problems:
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if not failures:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept the failed rounds' run directories under {root}")
    print(f"chaos: {args.rounds - failures}/{args.rounds} rounds ok; longest training silence {longest_gap_s} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
