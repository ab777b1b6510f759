"""Probe: does ``multihost_utils.live_devices`` (strategy (b)) survive a ``kill -9`` on CPU with gloo?

Not collected by pytest. 3 processes x 2 CPU devices join with ``jax.distributed.initialize`` (recoverability
on, JAX's heartbeat timeout 3 s) and loop over ``with live_devices(all devices) as live:`` around a jitted
sum over an array sharded on the live devices. Once every process has run ``--warm`` steps, ``--victim`` is
killed with SIGKILL. For each survivor it reports whether the loop raised ``ProcessFailureError`` (and how
long after the kill), whether, and how long after the kill, it then ran a step on the 4 live devices
without re-forming, or whether JAX ended it. ``--wait`` bounds the wait (a survivor that never reports is
"hung"). ``--victim 0`` kills the process that hosts JAX's coordination service.

    .venv-latest/bin/python tests/benchmarks/probe_live_devices.py [--trials 3] [--wait 30] [--victim 2]
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

NPROCS, LOCAL_DEVICES = 3, 2


def child(process_id: int, port: int) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(f"127.0.0.1:{port}", NPROCS, process_id, heartbeat_timeout_seconds=3)
    failure = getattr(multihost_utils, "ProcessFailureError", None) or Exception
    every = jax.devices()
    compiled: dict[tuple[int, ...], Any] = {}
    step = 0

    def say(**fields: Any) -> None:
        print(json.dumps({"t": time.time(), "step": step, **fields}), flush=True)

    while True:
        try:
            with multihost_utils.live_devices(every) as live:
                ids = tuple(d.id for d in live)
                mesh = Mesh(np.array(live), ("d",))
                sharding = NamedSharding(mesh, PartitionSpec("d"))
                local = [d for d in live if d.process_index == jax.process_index()]
                x = jax.make_array_from_process_local_data(sharding, np.ones(len(local) * 4, np.float32))
                if ids not in compiled:
                    compiled[ids] = jax.jit(lambda a: a.sum())
                total = float(compiled[ids](x))
            step += 1
            say(event="step", devices=len(ids), total=total)
        except failure as exc:
            say(event="raised", error=type(exc).__name__, message=str(exc)[:200])
        except Exception as exc:  # anything else is reported too: it is what the probe is for
            say(event="error", error=type(exc).__name__, message=str(exc)[:200])
            time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def trial(warm: int, wait: float, victim: int) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", str(i), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for i in range(NPROCS)
    ]
    sel = selectors.DefaultSelector()
    for i, proc in enumerate(procs):
        assert proc.stdout is not None
        sel.register(proc.stdout, selectors.EVENT_READ, i)
    steps = [0] * NPROCS
    killed_at: float | None = None
    steps_at_kill: list[int] = []
    found: dict[int, dict[str, Any]] = {i: {} for i in range(NPROCS) if i != victim}
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            for key, _ in sel.select(timeout=0.5):
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    sel.unregister(key.fileobj)
                    if killed_at is not None and key.data != victim:  # JAX ended a survivor
                        code = procs[key.data].wait()
                        found[key.data].update(exited_after_s=round(time.time() - killed_at, 3), exit_code=code)
                    continue
                if not line.startswith("{"):
                    continue  # not one of ours (a library printing to stdout)
                record, i = json.loads(line), key.data
                steps[i] = record["step"]
                if killed_at is None or i == victim:
                    continue
                after = round(record["t"] - killed_at, 3)
                if record["event"] in ("raised", "error") and "raised_after_s" not in found[i]:
                    found[i].update(raised_after_s=after, error=record["error"], message=record["message"])
                elif record["event"] == "step" and record["devices"] < NPROCS * LOCAL_DEVICES:
                    found[i].setdefault("resumed_after_s", after)
            if killed_at is None and min(steps) >= warm:
                killed_at, steps_at_kill = time.time(), list(steps)
                procs[victim].send_signal(signal.SIGKILL)
                deadline = killed_at + wait
            if killed_at is not None and all("resumed_after_s" in f or "exit_code" in f for f in found.values()):
                break
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {"killed": killed_at is not None, "steps_at_kill": steps_at_kill, "steps_at_end": steps, "survivors": found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--warm", type=int, default=20, help="steps every process runs before the kill")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the survivors after it")
    parser.add_argument("--victim", type=int, default=2, help="the process killed (0 hosts JAX's service)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.port)
        return
    import jax

    results = [trial(args.warm, args.wait, args.victim) for _ in range(args.trials)]
    resumed = [s["resumed_after_s"] for r in results for s in r["survivors"].values() if "resumed_after_s" in s]
    survivors = sum(len(r["survivors"]) for r in results)
    print(json.dumps({"jax": jax.__version__, "python": sys.version.split()[0], "trials": results}, indent=1))
    print(
        f"jax {jax.__version__}: {len(resumed)} of {survivors} survivors resumed on the live devices"
        + (f", median {statistics.median(resumed):.2f} s after the kill" if resumed else "")
    )


if __name__ == "__main__":
    main()
