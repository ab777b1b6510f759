"""Steady-state cost of the runtime against the bare JAX loop, same model, same mesh, same process.

The bare loop is what a user writes without us: the same step compiled with the same shardings (the
runtime's own ``StepCompiler``), batches put on the mesh, the loss read back every step (as a loop that logs
it does). Three more bare loops: with the runtime's host copy compiled into the step (the copy's own cost,
the floor for any runtime that copies the state to host memory every step on this machine), pipelined
(one step in flight, as the runtime's executor runs), and pipelined with the host copy. The runtime runs
the same job with snapshots off, with a RAM snapshot every step (both without the disk tier), and with every
default on (RAM snapshot every step, disk every 100 steps, background compiles, the scale-up watcher), and with
the defaults but RAM snapshots at the Young-Daly interval for an MTBF of 60 s (``snapshot_mtbf_s``); those two
are measured after their first 600 steps, by when the background compiles of the likely degraded meshes are
done. The state's fingerprint (silent data corruption) is on at its default in every runtime contender; three
more take it off, and on every step and every 10 steps, beside the RAM snapshot every step.

Each repeat runs every contender once, one after another; a contender's time is its median time per step
over the steady state (the first 20 steps, which include compiles, are left out). Its overhead is the ratio
to the blocking bare loop's time *of the same repeat*, and the figure is the median of those ratios over
the repeats, with their range: the machine's speed drifts by more than the effects measured, and pairing
each contender with a bare loop run seconds apart cancels the drift that a ratio of overall medians keeps.

On 8 or more devices the mesh is data 4 x model 2, as in the demo; on fewer (one GPU, say) it is data over all
of them. ``--batch/--features/--hidden`` scale the demo model up, so that a step on an accelerator is long
enough to be more than dispatch.

    .venv/bin/python tests/benchmarks/bench_overhead.py [--steps 200] [--repeats 12] [--json]
        [--batch 96 --features 256 --hidden 2048]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig, StepCompleted, read_events  # noqa: E402
from elastic_runtime.core.compiler import StepCompiler  # noqa: E402
from elastic_runtime.testing.demo_model import demo_job  # noqa: E402

WARMUP = 20
MODEL = {"global_batch": 96, "features": 256, "hidden": 2048}


def policy() -> MeshPolicy:
    devices = len(jax.devices())
    axes = {"data": 4, "model": 2} if devices >= 8 else {"data": devices, "model": 1}
    return MeshPolicy(axes, global_batch=MODEL["global_batch"], slice_size=axes["model"])


def bare_loop(steps: int, host_copy: bool = False, pipelined: bool = False) -> float:
    """A plain loop around the runtime's own compiled step (with ``host_copy``, the one that also writes the
    state to host memory), so that the contenders differ only in what drives the step."""
    job = demo_job(**MODEL)
    mesh = policy().fit(jax.devices())
    initial = job.init()
    compiler = StepCompiler(job, initial, job.data.batch(0), host_copy=host_copy)
    step = compiler.get(mesh)
    batch_sharding = compiler.batch_shardings(mesh)
    state = jax.device_put(initial, compiler.state_shardings(mesh))
    times = []
    previous: Any = None
    spare: Any = None  # host buffers whose copy was read: the next copy writes into them, as in the runtime
    started = time.perf_counter()
    for position in range(WARMUP + steps):
        batch = jax.device_put(job.data.batch(position), batch_sharding)
        if host_copy:
            buffers = compiler.fresh_buffers(mesh) if spare is None else spare
            state, metrics, *host = step(state, batch, buffers)
        else:
            state, metrics, *host = step(state, batch)
        pending = (metrics, host)
        if pipelined:  # wait for the previous step while this one computes
            pending, previous = previous, pending
            if pending is None:
                continue
        metrics, host = pending
        float(metrics["loss"])
        jax.block_until_ready(host)
        spare = host[0] if host else None
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
    return float(np.median(times[WARMUP:]))


def runtime_loop(steps: int, tmp: str, warmup: int = WARMUP, **options: Any) -> float:
    config = RuntimeConfig(run_dir=tmp, **options)
    result = ElasticRuntime(demo_job(**MODEL), config=config, mesh_policy=policy()).run(warmup + steps)
    assert result.events_path is not None
    commits = [e.mono_time for e in read_events(result.events_path) if isinstance(e, StepCompleted)]
    return float(np.median(np.diff(commits[warmup:])))  # commit to commit: everything between steps counts


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--json", action="store_true")
    for name, default in MODEL.items():
        parser.add_argument(f"--{name.removeprefix('global_')}", type=int, default=default, dest=name)
    args = parser.parse_args()
    MODEL.update({name: getattr(args, name) for name in MODEL})
    variants: dict[str, dict[str, Any]] = {
        "runtime, snapshots off": {
            "snapshot_every": 0,
            "precompile": False,
            "scale_up_poll_s": None,
            "checkpoint_dir": "",
        },
        "runtime, RAM snapshot every step": {
            "snapshot_every": 1,
            "precompile": False,
            "scale_up_poll_s": None,
            "checkpoint_dir": "",
        },
        # The state's fingerprint (runtime/core/fingerprint.py) against the line above, which has it at its
        # default (as often as costs 1% of a step): off, every step, every 10 steps.
        "runtime, RAM snapshot every step, no fingerprint": {
            "snapshot_every": 1,
            "precompile": False,
            "scale_up_poll_s": None,
            "checkpoint_dir": "",
            "fingerprint_every": 0,
        },
        "runtime, RAM snapshot + fingerprint every step": {
            "snapshot_every": 1,
            "precompile": False,
            "scale_up_poll_s": None,
            "checkpoint_dir": "",
            "fingerprint_every": 1,
        },
        "runtime, RAM snapshot + fingerprint every 10": {
            "snapshot_every": 1,
            "precompile": False,
            "scale_up_poll_s": None,
            "checkpoint_dir": "",
            "fingerprint_every": 10,
        },
        # Its first steps share the cores with the background compiles of the degraded meshes (about 5 s
        # here, once per run and after each mesh change): measured after them, like the others' steady state.
        "runtime, all defaults": {"warmup": 600},
        # The goodput benchmark's Young-Daly job: sparse RAM snapshots for one fault a minute, disk tier on.
        "runtime, Young-Daly snapshots (MTBF 60 s)": {"warmup": 600, "snapshot_mtbf_s": 60.0},
    }
    copy_floor = "bare JAX loop + the host copy in its step"
    pipelined = "bare JAX loop, pipelined"
    pipelined_floor = "bare JAX loop, pipelined + the host copy"
    bare = {"bare JAX loop": {}, copy_floor: {"host_copy": True}, pipelined: {"pipelined": True},
            pipelined_floor: {"pipelined": True, "host_copy": True}}  # fmt: skip
    samples: dict[str, list[float]] = {name: [] for name in [*bare, *variants]}
    for _ in range(args.repeats):
        for name, options in bare.items():
            samples[name].append(bare_loop(args.steps, **options))
        for name, config in variants.items():
            with tempfile.TemporaryDirectory() as tmp:
                samples[name].append(runtime_loop(args.steps, tmp, **config))
    rows = {}
    for name, times in samples.items():
        ratios = [t / b for t, b in zip(times, samples["bare JAX loop"], strict=True)]
        rows[name] = {
            "ms_per_step": round(float(np.median(times)) * 1000, 3),
            "ratio_to_bare": round(float(np.median(ratios)), 4),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        }
    if args.json:
        print(json.dumps(rows))
    else:
        print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}, model {MODEL}")
        for name, row in rows.items():
            low, high = row["ratio_range"]
            print(f"{name:42s} {row['ms_per_step']:8.3f} ms/step  x{row['ratio_to_bare']:.4f}  ({low}-{high})")


if __name__ == "__main__":
    main()
