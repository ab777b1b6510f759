"""Chaos loop for the multi-process mode (``make chaos``; not collected by pytest).

Each round kills real worker processes at random steps with random signals (kill -9 or SIGSTOP), sometimes
a second one while the group re-forms, sometimes from inside a worker mid-step or mid-replica-write, or
deadlocks a worker's step, or has a local process without the run's secret try to take the run over (an
impostor ``Hello``, a forged ``Heartbeat(step=600)`` and ``Finished`` for every id, with a kill on top; or
300 idle connections and a flood of malformed lines), and checks the final state against a fault-free run
(bitwise: every recovery keeps the full world size), the event log for lost committed steps, and that the
attacker was only ever sent the handshake's challenge.

    .venv/bin/python tests/multiprocess/chaos.py --rounds 10 [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from attacker import run_under_attack

from runtime.cli.demo_multiprocess import group_controller, run_group
from runtime.core.eventlog import read_events
from runtime.core.events import StateRestored, StepCompleted
from runtime.testing.grammar import Fault
from storage.disk import DiskTier

NPROCS = 3
STEPS = 40


def plan(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(
        ["kill", "kill", "stop", "two", "during-recovery", "midstep", "replica", "hang", "impostor", "flood"]
    )
    step = rng.randrange(3, STEPS - 8)
    pid = rng.randrange(NPROCS)
    match kind:
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
            return {"faults": [Fault("kill", pid, step=step), Fault("kill", rng.randrange(NPROCS), forming=True)]}
        case "midstep":
            return {"faults": [Fault("die-midstep", pid, step=step)]}
        case "hang":
            return {"faults": [Fault("hang", pid, step=step)], "hang_timeout_s": 2.0}
        case "impostor":
            return {"faults": [Fault("kill", pid, step=step)], "attack": "impostor"}
        case "flood":
            return {"faults": [], "attack": "flood"}
        case _:
            return {"faults": [Fault("die-writing-replica", pid, step=step)]}


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


def run_round(run_dir: Path, spec: dict[str, Any]) -> tuple[Any, list[str]]:
    """One round; with an ``attack``, what the attacker got through is a problem too."""
    attack = spec.pop("attack", None)
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
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="chaos-mp-"))
    print(f"chaos: {args.rounds} rounds, seed {args.seed}", flush=True)
    failures = 0
    try:
        reference = run_group(processes=NPROCS, steps=STEPS, run_dir=root / "reference", faults=[])
        assert reference.ok
        for i in range(args.rounds):
            spec = plan(rng)
            run_dir = root / f"round-{i}"
            started = time.monotonic()
            try:
                result, problems = run_round(run_dir, dict(spec))
                problems += [] if result.ok else [f"run failed: {result.reason}"]
                problems += check(run_dir, root / "reference" / "final")
            except Exception as exc:
                problems = [f"{type(exc).__name__}: {exc}"]
                result = None
            failures += bool(problems)
            summary = "" if result is None else f"{result.strategies} recoveries={len(result.recoveries)}"
            verdict = "FAIL " + "; ".join(problems) if problems else "ok"
            print(f"round {i}: {spec} {summary} {time.monotonic() - started:.1f} s: {verdict}", flush=True)
            if not problems:
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        if not failures:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept the failed rounds' run directories under {root}")
    print(f"chaos: {args.rounds - failures}/{args.rounds} rounds ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
