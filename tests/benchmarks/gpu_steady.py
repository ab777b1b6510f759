"""Steady step time on one accelerator: the flax example (MaxText's model through ``gpu_maxtext.py``) under the
runtime at its defaults against a bare jitted loop of the same step, paired, and what the RAM snapshot costs at
the model's size. A part of tests/benchmarks/gpu_campaign.sh; not collected by pytest.

    python3 tests/benchmarks/gpu_steady.py [--model flax] [--sizes example large] [--steps 100] [--warmup 20]
        [--repeats 3] [--config '{"FIELD": VALUE}'] [--deadline-s 50]

Each repeat runs every contender once, one after another, on the same model and mesh:

- ``bare``: a plain loop around the runtime's own compiled step, the loss read back every step;
- ``bare_host_copy``: the same step with the runtime's copy of the state to pinned host memory compiled in (the
  copy's own cost: the floor for anything that snapshots every step);
- ``runtime_off``: ``ElasticRuntime`` with snapshots, the disk tier, background compiles and the scale-up watch off;
- ``runtime_ram_every_step``: the same with a RAM snapshot every step (the copy fused into the step);
- ``runtime_defaults``: every default (RAM snapshot every step, disk every 100 steps, background compiles, the
  scale-up watch);
- ``runtime_defaults_config`` (only with ``--config``): the defaults plus those RuntimeConfig fields, for a
  feature's cost against the defaults (the state fingerprint's, once it exists).

A contender's figure is its median step over ``--steps`` steps after ``--warmup`` (the runtime's: between
committed steps); its ratio is to the bare loop *of the same repeat*, and the figure is the median of those ratios
over the repeats (bench_overhead.py's method: pairing cancels the machine's drift). JAX's persistent compilation
cache is on for the whole process, so only the first repeat compiles. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax
import numpy as np
from gpu_common import SIZES, Deadline, Model, bare_loop, build, emit, machine, runtime_loop

QUIET = {"precompile": False, "scale_up_poll_s": None, "checkpoint_dir": ""}
CONTENDERS: dict[str, dict[str, Any]] = {
    "bare": {"bare": {}},
    "bare_host_copy": {"bare": {"host_copy": True}},
    "runtime_off": {"runtime": {"snapshot_every": 0, **QUIET}},
    "runtime_ram_every_step": {"runtime": {"snapshot_every": 1, **QUIET}},
    "runtime_defaults": {"runtime": {}},
}


def contenders(config: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    if not config:
        return dict(CONTENDERS)
    return {**CONTENDERS, "runtime_defaults_config": {"runtime": dict(config)}}


def one(model: Model, how: dict[str, Any], *, steps: int, warmup: int) -> list[float]:
    if "bare" in how:
        return bare_loop(model, steps=steps, warmup=warmup, **how["bare"])
    with tempfile.TemporaryDirectory(prefix="gpu-steady-") as run_dir:
        return list(runtime_loop(model, steps=steps, warmup=warmup, run_dir=run_dir, **how["runtime"])["times"])


def measure_size(
    model: Model, *, steps: int, warmup: int, repeats: int, config: dict[str, Any] | None, deadline: Deadline
) -> dict[str, Any]:
    """Every contender ``repeats`` times in turn on ``model``, while the deadline allows."""
    chosen = contenders(config)
    samples: dict[str, list[float]] = {name: [] for name in chosen}
    longest = 0.0  # the slowest contender so far: what the next one may need
    partial = False
    for _ in range(repeats):
        for name, how in chosen.items():
            if not deadline.allows(1.5 * longest):
                partial = True
                break
            started = time.monotonic()
            samples[name].append(float(np.median(one(model, how, steps=steps, warmup=warmup))))
            longest = max(longest, time.monotonic() - started)
        if partial:
            break
    rows: dict[str, Any] = {}
    for name, times in samples.items():
        if not times:
            continue
        ratios = [t / b for t, b in zip(times, samples["bare"], strict=False)]  # repeat i with the bare loop's i
        rows[name] = {
            "median_ms": round(float(np.median(times)) * 1e3, 3),  # over the repeats, of each repeat's median step
            "ratio_to_bare": round(float(np.median(ratios)), 4) if ratios else None,
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
            "repeats": len(times),
        }

    def delta(a: str, b: str) -> float | None:
        return round(rows[a]["median_ms"] - rows[b]["median_ms"], 3) if a in rows and b in rows else None

    return {
        "model": model.name,
        "size": model.size,
        "state_mb": model.state_mb,
        "mesh": model.policy.target_shape,
        "contenders": rows,
        # What the RAM snapshot adds to a step at this size: in the runtime, and as the copy alone in a bare loop.
        "snapshot_cost_ms": delta("runtime_ram_every_step", "runtime_off"),
        "host_copy_cost_ms": delta("bare_host_copy", "bare"),
        "defaults_over_bare": rows.get("runtime_defaults", {}).get("ratio_to_bare"),
        "config_over_defaults": _config_over_defaults(samples),
        "partial": partial,
    }


def _config_over_defaults(samples: dict[str, list[float]]) -> float | None:
    pairs = list(zip(samples.get("runtime_defaults_config", []), samples["runtime_defaults"], strict=False))
    return round(float(np.median([a / b for a, b in pairs])), 4) if pairs else None


def steady(
    model_name: str,
    sizes: list[str],
    *,
    steps: int,
    warmup: int,
    repeats: int,
    config: dict[str, Any] | None,
    deadline: Deadline,
) -> dict[str, Any]:
    """The figures of every size that the deadline allows, keyed by size."""
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-steady-cache-") as cache:
        # Every contender after the first compiles nothing: the programs are the same in each repeat.
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        for size in sizes:
            if not deadline.allows(5.0):
                results[size] = {"skipped": "the part's time budget ran out before this size"}
                continue
            with tempfile.TemporaryDirectory(prefix="gpu-steady-model-") as run_dir:
                model = build(model_name, size, run_dir)
                results[size] = measure_size(
                    model, steps=steps, warmup=warmup, repeats=repeats, config=config, deadline=deadline
                )
    return {"machine": machine(), "steps": steps, "warmup": warmup, "sizes": results, "load_average": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["flax", "maxtext"], default="flax")
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=["example"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", type=json.loads, default=None, help="RuntimeConfig fields for one more contender")
    parser.add_argument("--deadline-s", type=float, default=None, help="start nothing that would end after this")
    args = parser.parse_args()
    emit(
        steady(
            args.model,
            args.sizes,
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats,
            config=args.config,
            deadline=Deadline(args.deadline_s),
        )
    )


if __name__ == "__main__":
    main()
