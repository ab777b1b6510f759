"""Probe: how often does a ``kill -9`` at a random moment make gloo abort a survivor (a second loss)?

Not collected by pytest. Each round launches the demo job (``launch --nprocs 4 --spares 1``, no step delay: the
steps run back to back, so the kill usually lands inside the step's all-reduce), waits for step 20, sleeps
0-0.1 s, SIGKILLs a random member other than process 0's, lets the group recover for ``--settle`` seconds and
stops the run with SIGTERM. A round counts as aborted when a lost survivor's log ends with gloo's abort
(``elastic_runtime.testing.launched.GLOO_ABORT``: ``std::terminate`` in gloo's transport thread;
docs/multiprocess.md, "JAX limits met"). ``--xla-flags`` alternates rounds between flag sets (comma separated;
an empty item is the default), to try a change against the default in the same run.

    .venv/bin/python tests/benchmarks/probe_gloo_abort.py [--rounds 10] [--xla-flags ",--xla_foo=1"]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from elastic_runtime.cli.demo_multiprocess import worker_command
from elastic_runtime.core.events import GroupFormed, WorkerLost, WorkerStarted
from elastic_runtime.testing import launched


def round_(run_dir: Path, settle_s: float) -> tuple[int, list[int], list[int]]:
    """One launch and kill: the victim, the workers lost, those of them gloo aborted."""
    flags = ("--spares", "1", "--max-failures", "3")
    controller = launched.launch(run_dir, worker_command(10_000), *flags, nprocs=4)
    launched.wait_for_step(run_dir, controller, 20)
    events = launched.events_so_far(run_dir)
    victim = random.choice(next(e for e in events if isinstance(e, GroupFormed)).members[1:])
    time.sleep(random.random() * 0.1)
    os.kill(next(e.pid for e in events if isinstance(e, WorkerStarted) and e.worker == victim), signal.SIGKILL)
    time.sleep(settle_s)
    controller.send_signal(signal.SIGTERM)
    try:
        controller.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        controller.kill()
        controller.communicate()
    lost = [e.worker for e in launched.events_so_far(run_dir) if isinstance(e, WorkerLost)]
    return victim, lost, launched.aborted_by_gloo(run_dir, lost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--settle", type=float, default=8.0, help="seconds between the kill and the run's stop")
    parser.add_argument("--xla-flags", default="", help="flag sets, comma separated, alternated by round")
    args = parser.parse_args()
    flag_sets = args.xla_flags.split(",")
    tally: dict[str, list[bool]] = {flags: [] for flags in flag_sets}
    with tempfile.TemporaryDirectory(prefix="probe-gloo-") as folder:
        for number in range(args.rounds):
            flags = flag_sets[number % len(flag_sets)]
            os.environ["XLA_FLAGS"] = flags
            victim, lost, aborted = round_(Path(folder) / f"round-{number}", args.settle)
            tally[flags].append(bool(aborted))
            print(f"round {number} [{flags or 'default'}]: killed {victim}, lost {lost}, aborted by gloo: {aborted}")
    for flags, rounds in tally.items():
        print(f"{flags or 'default'}: a survivor aborted in {sum(rounds)} of {len(rounds)} rounds")
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
