"""Reproduction without the runtime of gloo aborting a survivor after a ``kill -9`` (for an upstream report).

Not collected by pytest. Plain ``jax.distributed`` (4 processes x 2 CPU devices by default, gloo): each process
loops over one jitted step whose collectives have the demo step's shape: a ``psum`` over the devices inside the
process (the ``model`` axis) whose result feeds a scalar, then one ``psum`` over the processes of 1 KB, 128 KB,
1 KB and that scalar (XLA combines them into one tuple all-reduce). One process (never 0, which hosts the coordination
service) SIGKILLs itself at a random moment; the survivors catch their step's error and keep their sockets open
for 2 s, as a survivor does until its group re-forms. Counts the survivors ended by
``terminate called after throwing an instance of 'gloo::EnforceNotMet'`` instead (docs/multiprocess.md, "JAX
limits met"). ``--no-inner`` drops the in-process ``psum``; ``--devices 1`` leaves one gloo context a process.

    .venv/bin/python tests/benchmarks/repro_gloo_abort.py [--rounds 12] [--devices 2] [--recoverable] [--no-inner]
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
import time

NPROCS, HOLD_S = 4, 2.0


def child(process_id: int, port: int, victim: int, seed: int, devices: int, recoverable: bool, inner: bool) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", recoverable)
    jax.distributed.initialize(f"127.0.0.1:{port}", NPROCS, process_id, heartbeat_timeout_seconds=100)
    mesh = Mesh(np.array(jax.devices()).reshape(NPROCS, devices), ("data", "model"))
    spec = PartitionSpec(("data", "model"))

    def step(a: jax.Array, b: jax.Array, c: jax.Array, h: jax.Array) -> tuple[jax.Array, ...]:
        summed = jax.lax.psum(h, "model") if inner else h
        scalar = (summed * summed).sum().reshape(1)
        return jax.lax.psum((a * 1.0001, b * 1.0001, c * 1.0001, scalar), "data")

    compiled = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

    def ones(shape: tuple[int, ...]) -> jax.Array:
        whole = np.ones((NPROCS * devices, *shape), np.float32)
        return jax.make_array_from_callback(whole.shape, NamedSharding(mesh, spec), lambda index: whole[index])

    inputs = [ones((256,)), ones((256, 128)), ones((1, 256)), ones((24,))]
    jax.block_until_ready(compiled(*inputs))
    if process_id == victim:
        delay = 0.2 + random.Random(seed).random() * 0.3
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        while True:
            jax.block_until_ready(compiled(*inputs))
    except Exception as error:  # the recoverable outcome: the step raised
        print(f"raised: {str(error)[:160]}", flush=True)
        time.sleep(HOLD_S)
        os._exit(0)  # abandoned collectives may be blocked inside XLA: no interpreter shutdown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--recoverable", action="store_true", help="jax_enable_recoverability on")
    parser.add_argument("--no-inner", action="store_true", help="no psum inside the process")
    args = parser.parse_args()
    survivors = aborted = 0
    for number in range(args.rounds):
        victim = 1 + number % (NPROCS - 1)
        flags = [args.devices, int(args.recoverable), int(not args.no_inner)]
        settings = [str(free_port()), str(victim), str(number), *map(str, flags)]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--child", str(i), *settings],
                stdout=subprocess.DEVNULL,
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
            if i != victim:
                survivors += 1
                if b"EnforceNotMet" in err:
                    aborted += 1
                    print(f"round {number}: process {i} aborted (process {victim} killed)", flush=True)
    print(f"{aborted} of {survivors} survivors aborted in {args.rounds} rounds; load average {os.getloadavg()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        process_id, port, victim, seed, devices, recoverable, inner = map(int, sys.argv[2:9])
        child(process_id, port, victim, seed, devices, bool(recoverable), bool(inner))
    else:
        main()
