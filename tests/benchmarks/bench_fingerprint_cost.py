"""What the state's fingerprint (silent data corruption, one process) costs a step at a given state size: the demo
model scaled to ``--mb`` of state (parameters and momentum), 8 virtual CPU devices (data 4 x model 2), the
fingerprint off, at its default cadence (as often as costs 1% of a step, measured as the run goes), every 10 steps
and every step; a RAM snapshot every step in all. Each repeat runs the four back to back (order rotated); a
contender's time is its median commit-to-commit step after ``--warmup`` steps, its cost the ratio to the run
without the fingerprint of the same repeat; the figures are the medians over the repeats.

    .venv/bin/python tests/benchmarks/bench_fingerprint_cost.py --mb 256 [--steps 20] [--repeats 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig, StepCompleted, read_events  # noqa: E402
from elastic_runtime.testing.demo_model import demo_job  # noqa: E402

HIDDEN = 2048
CONTENDERS: dict[str, int | None] = {"off": 0, "default": None, "every 10": 10, "every step": 1}


def step_s(features: int, steps: int, warmup: int, every: int | None) -> tuple[float, int]:
    """The median step with the fingerprint at ``every``, and the cadence it ran at in the end."""
    with tempfile.TemporaryDirectory(prefix="bench-fingerprint-") as tmp:
        config = RuntimeConfig(
            run_dir=tmp,
            precompile=False,
            scale_up_poll_s=None,
            progress=False,
            snapshot_every=1,
            checkpoint_dir="",
            fingerprint_every=every,
        )
        job = demo_job(global_batch=96, features=features, hidden=HIDDEN)
        runtime = ElasticRuntime(job, config=config, mesh_policy=MeshPolicy({"data": 4, "model": 2}, global_batch=96))
        result = runtime.run(warmup + steps)
        assert result.events_path is not None
        commits = [e.mono_time for e in read_events(result.events_path) if isinstance(e, StepCompleted)]
        integrity = runtime.executor.integrity
        cadence = integrity.every if integrity is not None else 0
        return float(np.median(np.diff(commits[warmup:]))), cadence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mb", type=int, default=256, help="state size: parameters and momentum, float32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    features = max(1, (args.mb << 20) // (2 * 4 * HIDDEN))  # w1 (features x hidden) and its momentum dominate
    out: dict[str, Any] = {
        "mb": args.mb,
        "features": features,
        "hidden": HIDDEN,
        "load_average_before": os.getloadavg(),
    }
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    ratios: dict[str, list[float]] = {name: [] for name in CONTENDERS if name != "off"}
    cadence: dict[str, int] = {}
    names = list(CONTENDERS)
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        got = {}
        for name in order:
            got[name], cadence[name] = step_s(features, args.steps, args.warmup, CONTENDERS[name])
            times[name].append(got[name])
        for name in ratios:
            ratios[name].append(got[name] / got["off"])
    out["step_s"] = {name: round(statistics.median(t), 4) for name, t in times.items()}
    out["ratio_to_off"] = {name: round(statistics.median(r), 3) for name, r in ratios.items()}
    out["ratios"] = {name: [round(x, 3) for x in r] for name, r in ratios.items()}
    out["default_cadence_steps"] = cadence["default"]
    out["load_average_after"] = os.getloadavg()
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
