"""What the script's handlers cost a step under ``launch`` (issue 60): the step boundary's agreement on the newest
notification every member holds, one 4-byte all-gather a step, runs only when the script subscribed to an event
(``runtime/cluster/worker/boundary.py``). Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_handler_boundary.py [--repeats 3] [--steps 120] [--nprocs 3] [--json]

Two contenders, the same user script (this file with ``--script``: the demo model through ``ElasticRuntime.run``)
under ``elastic-runtime launch`` (the Controller API, fault-free), one after the other in each repeat: ``plain``
subscribes to nothing, ``handler`` subscribes one no-op handler to ``MeshChanged`` (the handlers docs' example:
scale the learning rate with the group's size). A contender's step is its mean step after the warm-up (as
``bench_overhead_multiprocess.py``); the ratio is the median over the repeats of ``handler`` over ``plain`` of
the same repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def script(steps: int, subscribe: bool) -> None:
    """The user's script: the demo model, run by the runtime (under ``launch``: in every worker)."""
    from elastic_runtime import ElasticRuntime, MeshChanged
    from elastic_runtime.cli.demo_multiprocess import FEATURES, GLOBAL_BATCH, HIDDEN
    from elastic_runtime.testing.demo_model import demo_job

    runtime = ElasticRuntime(demo_job(global_batch=GLOBAL_BATCH, features=FEATURES, hidden=HIDDEN))
    if subscribe:

        @runtime.on(MeshChanged)
        async def rescale(event: MeshChanged, ctx: Any) -> None:
            pass  # what it does does not matter: subscribing turns the boundary's all-gather on

    runtime.run(steps)


def run(root: Path, nprocs: int, steps: int, subscribe: bool) -> list[float]:
    from elastic_runtime.cli.demo_multiprocess import group_controller
    from elastic_runtime.core.eventlog import read_events
    from elastic_runtime.core.events import StepCompleted

    command = [sys.executable, __file__, "--script", "--steps", str(steps), *(["--subscribe"] if subscribe else [])]
    timeouts = {"heartbeat_timeout_s": 60.0, "hang_timeout_s": 120.0, "spawn_timeout_s": 300.0}
    result = group_controller(processes=nprocs, steps=steps, run_dir=root, faults=[], command=command, **timeouts).run()
    if not result.ok:
        raise RuntimeError(f"run failed: {result.reason} (see {root})")
    return [e.mono_time for e in read_events(root / "events.jsonl") if isinstance(e, StepCompleted)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--nprocs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--script", action="store_true", help=argparse.SUPPRESS)  # a worker's script (internal)
    parser.add_argument("--subscribe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.script:
        script(args.steps, args.subscribe)
        return
    sys.path.insert(0, str(HERE))
    from bench_overhead_multiprocess import step_time

    warmup = min(20, args.steps // 3)
    samples: dict[str, list[float]] = {"plain": [], "handler": []}
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory(prefix="bench-handler-") as tmp:
        for repeat in range(args.repeats):
            for name in samples:
                times = run(Path(tmp) / f"{name}-{repeat}", args.nprocs, args.steps, name == "handler")
                samples[name].append(step_time(times, warmup))
                print(f"repeat {repeat + 1} {name}: {samples[name][-1] * 1000:.2f} ms/step", file=sys.stderr)
    ratios = [h / p for h, p in zip(samples["handler"], samples["plain"], strict=True)]
    summary = {
        "nprocs": args.nprocs,
        "steps": args.steps,
        "plain_median_s": round(statistics.median(samples["plain"]), 5),
        "handler_median_s": round(statistics.median(samples["handler"]), 5),
        "handler_ratio": round(statistics.median(ratios), 3),
        "handler_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "added_ms_per_step": round(
            1000 * statistics.median(h - p for h, p in zip(samples["handler"], samples["plain"], strict=True)), 3
        ),
        "loadavg_start": load_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
