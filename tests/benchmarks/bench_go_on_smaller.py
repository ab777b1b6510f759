"""Going on smaller rather than waiting (issue 61): ``launch --nprocs 3 --spares 0``, a worker killed at step 8,
its replacement 30 s slow to start (a cold node), the user script of ``tests/userscript/train.py``. With
``--min-nprocs 2`` the survivors go on at once and the group grows back when the replacement joins; with
``--min-nprocs 3`` the group waits for it, idle, as every group did before. Per run: the kill to the next
commit, the group's sizes, goodput (``report``) and the wall; the final state of a run whose group kept its size
bitwise against a fault-free run (one whose group changed size trained other steps on purpose: the script's
``MeshChanged`` handler scales its learning rate with the data-parallel size, the ``lr`` in its state).

    .venv/bin/python tests/benchmarks/bench_go_on_smaller.py [--slow-s 30] [--steps 200] [--slices 2] [--json]

With ``--slices 2``: ``launch --nprocs 4 --slices 2``, the slice of the killed process lost, the group going on
with the other (``--min-nprocs 2``) or waiting (``--min-nprocs 4``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from elastic_runtime import RecoveryCompleted, read_events
from elastic_runtime.analysis.goodput import goodput
from elastic_runtime.core.compare import compare_states
from elastic_runtime.storage.disk import DiskTier

SCRIPT = Path(__file__).resolve().parents[1] / "userscript" / "train.py"


def launch(
    run_dir: Path, *, nprocs: int, slices: int, min_nprocs: int, slow_s: float, steps: int, kill: bool
) -> dict[str, Any]:
    command = [sys.executable, "-m", "elastic_runtime.cli", "launch", "--nprocs", str(nprocs), "--spares", "0"]
    command += ["--slices", str(slices), "--min-nprocs", str(min_nprocs)]
    command += ["--run-dir", str(run_dir), "--result", str(run_dir / "final")]
    command += ["--quiet", "--spawn-timeout", "600"] + (["--fault", "kill:1@8"] if kill else [])
    command += ["--", sys.executable, str(SCRIPT), "--steps", str(steps), "--slow-replacement-s", str(slow_s)]
    command += ["--first-workers", str(nprocs)]
    command += ["--batch-delay-s", "0.05"]  # a step of about 0.1 s: the run outlasts the slow replacement
    env = os.environ | {"USER_HANDLERS_OUT": str(run_dir)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    summary = json.loads((run_dir / "summary.json").read_text())
    events = read_events(run_dir / "events.jsonl")
    report = goodput(events)
    recovered = [e for e in events if isinstance(e, RecoveryCompleted)]
    return {
        "ok": done.returncode == 0 and summary["ok"],
        "world_size_history": summary["world_size_history"],
        "kill_to_next_commit_s": round(recovered[0].recovery_s, 3) if recovered else None,
        "lost_steps": sum(e.lost_steps for e in recovered),
        "goodput": round(report.productive_s / report.wall_s, 4),
        "wall_s": round(report.wall_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--slow-s", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--slices", type=int, default=0, help="2: 4 processes in 2 slices, one slice fewer")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # 3 processes, one per slice, going on with 2; or 2 slices of 2 processes, going on with one slice.
    nprocs, smaller = (3, 2) if not args.slices else (2 * args.slices, 2 * (args.slices - 1))
    shape = {"nprocs": nprocs, "slices": args.slices, "slow_s": args.slow_s, "steps": args.steps}
    root = Path(tempfile.mkdtemp(prefix="bench-smaller-"))
    reference = launch(root / "reference", min_nprocs=nprocs, kill=False, **(shape | {"slow_s": 0}))
    assert reference["ok"], reference
    want = DiskTier(root / "reference" / "final").latest(None).tree
    out: dict[str, Any] = {"slow_replacement_s": args.slow_s, "steps": args.steps, "nprocs": nprocs}
    out["slices"] = args.slices
    for name, min_nprocs in (("go_on_smaller", smaller), ("wait", nprocs)):
        run_dir = root / name
        out[name] = launch(run_dir, min_nprocs=min_nprocs, kill=True, **shape)
        got = DiskTier(run_dir / "final").latest(None).tree
        if len(set(out[name]["world_size_history"])) == 1:
            out[name]["reference"] = compare_states(got, want, bitwise=True)
        else:  # the script's MeshChanged handler scales its learning rate with the data-parallel size
            lr = np.asarray(got["lr"]).ravel().tolist()
            out[name]["reference"] = {"skipped": "the learning rate followed the group's size", "lr": lr}
    waited, went_on = out["wait"]["kill_to_next_commit_s"], out["go_on_smaller"]["kill_to_next_commit_s"]
    out["kill_to_next_commit_ratio"] = round(went_on / waited, 4) if waited and went_on else None
    out["wall_ratio"] = round(out["go_on_smaller"]["wall_s"] / out["wait"]["wall_s"], 4)
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, default=lambda x: float(np.asarray(x))) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
