"""Probe: does a ``kill -9`` in the middle of a tuple all-reduce make gloo abort a survivor on CPU?

Not collected by pytest. 4 processes x 2 CPU devices join with ``jax.distributed.initialize`` and loop over one
jitted ``psum`` over the process axis of four arrays the sizes of the demo step's gradients (1 KB, 128 KB, 1 KB,
4 bytes: XLA combines them into one tuple all-reduce, as in the demo's step). ``--victim`` kills itself with
SIGKILL at a random moment 0.2-0.5 s into the loop. For each survivor it counts whether its step raised (a
``JaxRuntimeError``, the recoverable outcome) or gloo aborted it (``gloo::EnforceNotMet``, as seen once in 10 runs
of ``tests/multiprocess/test_worker_sigterm.py``; docs/multiprocess.md, "JAX limits met").

    .venv/bin/python tests/benchmarks/probe_gloo_abort.py [--rounds 6] [--victim 2]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading

NPROCS, LOCAL_DEVICES = 4, 2
SHAPES = [(256,), (256, 128), (1, 256), ()]


def child(process_id: int, port: int, victim: int, seed: int) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", NPROCS, process_id, heartbeat_timeout_seconds=100)
    mesh = Mesh(np.array(jax.devices()).reshape(NPROCS, LOCAL_DEVICES), ("data", "model"))
    spec = PartitionSpec(("data", "model"))
    summed = jax.jit(
        jax.shard_map(lambda *xs: jax.lax.psum(xs, "data"), mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    )

    def ones(shape: tuple[int, ...]) -> jax.Array:
        whole = np.ones((NPROCS * LOCAL_DEVICES, *shape), np.float32)
        return jax.make_array_from_callback(whole.shape, NamedSharding(mesh, spec), lambda index: whole[index])

    inputs = [ones(shape) for shape in SHAPES]
    jax.block_until_ready(summed(*inputs))
    if process_id == victim:
        delay = 0.2 + random.Random(seed).random() * 0.3
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        while True:
            jax.block_until_ready(summed(*inputs))
    except Exception as error:  # the recoverable outcome: the step raised
        print(f"raised: {str(error)[:160]}", flush=True)
        os._exit(0)  # abandoned collectives may be blocked inside XLA: no interpreter shutdown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--victim", type=int, default=2, help="not 0: process 0 hosts JAX's coordination service")
    args = parser.parse_args()
    counts = {"raised": 0, "aborted": 0, "other": 0}
    for round_ in range(args.rounds):
        port = free_port()
        command = [sys.executable, __file__, "--child"]
        procs = [
            subprocess.Popen(
                [*command, str(i), str(port), str(args.victim), str(round_)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for i in range(NPROCS)
        ]
        for i, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if i == args.victim:
                continue
            outcome = "aborted" if b"EnforceNotMet" in err else "raised" if proc.returncode == 0 else "other"
            counts[outcome] += 1
            print(f"round {round_}: process {i} {outcome} (exit code {proc.returncode})", flush=True)
    print(f"survivors: {counts}; load average {os.getloadavg()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*map(int, sys.argv[2:6]))
    else:
        main()
