"""Silent data corruption under launch (docs/integrity.md, *Under launch*): what comparing the slices after every
step costs, paired with the same group without it, and a flipped bit and a worker that computes wrong, each found,
healed and compared bitwise with a fault-free run. The demo job's group (``elastic-runtime demo --processes``),
2 CPU devices per worker, gloo on loopback.

    .venv/bin/python tests/benchmarks/bench_integrity_slices.py [--processes 4] [--slices 2] [--steps 100]
        [--repeats 3] [--mb MB] [--json]

``--mb``: the model scaled to about that much state (parameters and momentum) in each slice, as ``bench_slices.py``
(``--processes 2 --slices 2``: every process holds it whole); 0, the default: the demo's size.

The step time is the median gap between the group's consecutive ``StepCompleted`` events past the first 10 steps
(the controller's clock); the ratio is taken within each repeat (the two runs back to back, alternating which goes
first) and its median reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from elastic_runtime.cli.demo_multiprocess import run_group, worker_command
from elastic_runtime.core.compare import compare_states
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import CorruptionHealed, SilentCorruption, StepCompleted
from elastic_runtime.faults.grammar import Fault
from elastic_runtime.storage.disk import DiskTier

sys.path.insert(0, str(Path(__file__).parent))
from bench_slices import size_for


def launched(root: Path, args: argparse.Namespace, *, fingerprint: bool, faults: list[Fault]) -> dict[str, Any]:
    size = {"features": size_for(args.mb), "hidden": size_for(args.mb)} if args.mb else {}
    command = worker_command(args.steps, fingerprint=fingerprint, **size)
    result = run_group(
        processes=args.processes, slices=args.slices, steps=args.steps, run_dir=root, faults=faults, command=command
    )
    events = read_events(root / "events.jsonl")
    at = {e.step: e.mono_time for e in events if isinstance(e, StepCompleted) and e.step is not None}
    gaps = [at[s] - at[s - 1] for s in range(11, args.steps + 1) if s in at and s - 1 in at]
    return {
        "ok": result.ok,
        "step_s": statistics.median(gaps) if gaps else None,
        "found": [e for e in events if isinstance(e, SilentCorruption)],
        "healed": [e for e in events if isinstance(e, CorruptionHealed)],
        "lost_steps": sum(r["lost_steps"] for r in result.recoveries),
        "state": DiskTier(root / "final").latest(None).tree,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--slices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mb", type=float, default=0.0, help="state per slice (0: the demo's size)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out: dict[str, Any] = {k: getattr(args, k) for k in ("processes", "slices", "steps", "repeats", "mb")}
    out["load_average_before"] = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-integrity-slices-") as tmp:
        root = Path(tmp)
        ratios, plain_s, checked_s, alarms, reference = [], [], [], 0, None
        for repeat in range(args.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            runs = {on: launched(root / f"r{repeat}-{on}", args, fingerprint=on, faults=[]) for on in order}
            alarms += len(runs[True]["found"])
            plain_s.append(runs[False]["step_s"])
            checked_s.append(runs[True]["step_s"])
            ratios.append(runs[True]["step_s"] / runs[False]["step_s"])
            reference = runs[False]["state"]
        out["step_s_without"] = round(statistics.median(plain_s), 5)
        out["step_s_with"] = round(statistics.median(checked_s), 5)
        out["ratio_median"] = round(statistics.median(ratios), 3)
        out["ratios"] = [round(r, 3) for r in ratios]
        out["false_alarms"] = alarms
        at = args.steps // 2
        for kind in ("corrupt", "corrupt-persistent"):
            run = launched(root / kind, args, fingerprint=True, faults=[Fault(kind, 1, step=at)])
            found, healed = run["found"], run["healed"]
            out[kind] = {
                "ok": run["ok"],
                "injected_after_step": at,
                "detected_step": found[0].step if found else None,
                "workers": list(found[-1].workers) if found else [],
                "kind": healed[-1].kind if healed else None,
                "healed_s": round(healed[-1].seconds, 3) if healed else None,
                "lost_steps": run["lost_steps"],
                "bitwise": compare_states(run["state"], reference, bitwise=True)["match"],
            }
    out["load_average_after"] = os.getloadavg()
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
