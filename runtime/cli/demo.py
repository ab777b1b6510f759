"""``elastic-runtime demo``: train a small real model on 8 virtual CPU devices, lose a slice, recover.

The run loses slice 3 (devices 6 and 7) a third of the way in, recovers in-process on 6 devices from the RAM
snapshot, gets the slice back two thirds of the way in, scales up to 8 and finishes. Progress is printed as
it happens; with ``--json`` the last line is a JSON summary, and ``--verify`` compares the final parameters
with a fault-free run of the same length made in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_STEPS = 300
SLICE_SIZE = 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo", help="train a small model, lose a slice mid-run, recover in-process", description=__doc__
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"steps to train (default {DEFAULT_STEPS}; with --hosts 60)"
    )
    parser.add_argument("--devices", type=int, default=8, help="virtual CPU devices (default %(default)s)")
    parser.add_argument("--fault-at", type=int, default=None, help="step at which a slice is lost (default steps/3)")
    parser.add_argument("--repair-at", type=int, default=None, help="step at which it returns (default 2*steps/3)")
    parser.add_argument("--no-fault", action="store_true", help="run without injecting a fault")
    parser.add_argument(
        "--corrupt-at",
        type=int,
        default=None,
        metavar="STEP",
        help="silent data corruption instead of a lost slice: a bit of one device's copy of the state flipped after "
        "STEP (found by the state's fingerprint, every step here; healed by replay)",
    )
    parser.add_argument(
        "--persistent",
        action="store_true",
        help="with --corrupt-at or --corrupt-worker-at: the device computes wrong from then on (evicted)",
    )
    parser.add_argument(
        "--fault-schedule",
        metavar="ITEMS",
        help="faults to inject instead, e.g. 'lose-slice:1@50,repair-slice:1@120,lose-device:0@30s' "
        "(ACTION:TARGET@STEP or @SECONDSs; TARGET an index or 'random')",
    )
    parser.add_argument("--fault-every", type=float, metavar="S", help="lose a random slice every S seconds")
    parser.add_argument("--repair-after", type=float, default=20.0, metavar="S", help="with --fault-every (default 20)")
    parser.add_argument("--run-dir", default=None, help="where to write events.jsonl (default runs/demo-<time>)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    parser.add_argument("--verify", action="store_true", help="compare with a fault-free run of the same length")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    # Multi-process mode: --processes N --kill-worker-at STEP, handled by runtime/cli/demo_multiprocess.py.
    from elastic_runtime.cli.demo_multiprocess import add_multiprocess_arguments

    add_multiprocess_arguments(parser)
    # Multi-host mode on simulated hosts: --hosts N --lose-host-at STEP, handled by runtime/cli/demo_hosts.py.
    from elastic_runtime.cli.demo_hosts import add_hosts_arguments

    add_hosts_arguments(parser)
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    if getattr(args, "hosts", 0):  # multi-host mode on simulated hosts: its own module
        from elastic_runtime.cli.demo_hosts import DEFAULT_STEPS as HOSTS_STEPS
        from elastic_runtime.cli.demo_hosts import run_hosts_demo

        args.steps = HOSTS_STEPS if args.steps is None else args.steps
        return run_hosts_demo(args)
    if args.steps is None:
        args.steps = DEFAULT_STEPS
    if getattr(args, "processes", 0):  # multi-process mode: its own module
        from elastic_runtime.cli.demo_multiprocess import run_multiprocess_demo

        return run_multiprocess_demo(args)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    from elastic_runtime import ElasticRuntime, Event, MeshPolicy, RuntimeConfig, read_events
    from elastic_runtime.analysis.summary import corruption_summary, summarize
    from elastic_runtime.cli.progress import ProgressPrinter
    from elastic_runtime.core.compare import compare_states
    from elastic_runtime.testing import FaultInjector
    from elastic_runtime.testing.demo_model import demo_job
    from elastic_runtime.testing.faults import FaultSchedule

    if len(jax.devices()) < 2 * SLICE_SIZE:
        print(f"demo needs at least {2 * SLICE_SIZE} devices, found {len(jax.devices())}", file=sys.stderr)
        return 2
    steps = args.steps
    fault_at = args.fault_at if args.fault_at is not None else max(steps // 3, 1)
    repair_at = args.repair_at if args.repair_at is not None else max(2 * steps // 3, fault_at + 1)
    slices = len(jax.devices()) // SLICE_SIZE
    # The batch must split evenly over the full and the degraded data axis: the global batch stays the same.
    base = math.lcm(slices, slices - 1)
    global_batch = base * max(1, 96 // base)
    policy = MeshPolicy({"data": slices, "model": SLICE_SIZE}, global_batch=global_batch, slice_size=SLICE_SIZE)
    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    # The demo prints its own progress; with --corrupt-at every step's state is fingerprinted.
    config = RuntimeConfig(
        run_dir=str(run_dir), scale_up_poll_s=0.1, progress=False, fingerprint_every=1 if args.corrupt_at else None
    )
    job = demo_job(global_batch=global_batch)
    injector = FaultInjector()
    devices = len(jax.devices())
    try:
        if args.fault_every:
            schedule = FaultSchedule.every(
                args.fault_every, repair_after_s=args.repair_after, slice_size=SLICE_SIZE, devices=devices
            )
        else:
            default = f"lose-slice:{slices - 1}@{fault_at},repair-slice:{slices - 1}@{repair_at}"
            text = "" if args.no_fault or args.corrupt_at else (args.fault_schedule or default)
            schedule = FaultSchedule.parse(text, slice_size=SLICE_SIZE, devices=devices)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    say = (lambda *a: None) if args.quiet else print
    say(f"elastic-runtime demo: {steps} steps on {devices} CPU devices, mesh {policy.target_shape}")
    say(f"  faults (slices of {SLICE_SIZE} devices): {schedule}")

    if args.corrupt_at:
        suspect = devices - SLICE_SIZE  # the last slice's first device
        how = "from then on" if args.persistent else "once"
        say(f"  silent data corruption: a bit of device {suspect}'s copy flipped after step {args.corrupt_at}, {how}")
        injector.corrupt(args.corrupt_at, suspect, persistent=args.persistent)
    runtime = injector.attach(ElasticRuntime(job, config=config, mesh_policy=policy))
    runtime.at_step_boundary(schedule.hook(injector))
    if not args.quiet:
        runtime.subscribe(Event, ProgressPrinter(), priority=-100)
    started = time.monotonic()
    result = runtime.run(steps)
    events = read_events(result.events_path or run_dir / "events.jsonl")
    summary = summarize(events)
    if args.corrupt_at:
        summary["corruption"] = corruption_summary(events, args.corrupt_at)
    summary["run_dir"] = str(run_dir)
    summary["seconds"] = round(time.monotonic() - started, 3)

    if args.verify:
        say("verifying: fault-free reference run of the same length ...")
        reference = ElasticRuntime(
            job, config=RuntimeConfig(scale_up_poll_s=None, precompile=False, progress=False), mesh_policy=policy
        ).run(steps)
        full = all(entry["shape"] == policy.target_shape for entry in summary["mesh_history"])
        summary["reference_match"] = compare_states(result.state, reference.state, bitwise=full)

    say(render(summary))
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ok"] and summary.get("reference_match", {}).get("match", True) else 1


def render(summary: dict[str, Any]) -> str:
    wall = summary["wall_s"]
    lines = [
        "",
        f"finished {summary['steps_completed']} steps in {wall:.2f} s, final loss {summary['final_loss']:.5f}",
        f"goodput {summary['goodput']:.1%} (productive step time {summary['productive_s']:.2f} s of {wall:.2f} s)",
    ]
    for failure in summary["failures"]:
        lines.append(
            f"failure {failure['kind']} at step {failure['step']}: recovered in {failure['recovery_s']:.3f} s, "
            f"lost {failure['lost_steps']} step(s), restored from {failure['restored_from']}, "
            f"then ran on {failure['mesh_after']}"
        )
    history = " -> ".join(f"{e['shape']}@{e['step']}" for e in summary["mesh_history"])
    lines.append(f"mesh history: {history}")
    match = summary.get("reference_match")
    if match:
        verdict = "holds" if match["match"] else "FAILS"
        lines.append(
            f"reference check ({match['comparison']}) {verdict}: max relative error {match['max_rel_error']:.2e}"
        )
    lines.append(f"event log: {summary['run_dir']}/events.jsonl")
    return "\n".join(lines)
