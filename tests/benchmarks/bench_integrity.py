"""Silent data corruption in one process (docs/integrity.md): false alarms over fault-free runs, optionally beside
CPU burners, and a flipped bit and a device that computes wrong, each found, healed and compared with a fault-free
run. The demo model on 8 virtual CPU devices (data 4 x model 2), the state fingerprinted every step.

    .venv/bin/python tests/benchmarks/bench_integrity.py [--runs 20] [--steps 200] [--burners 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

from elastic_runtime import (  # noqa: E402
    CorruptionHealed,
    ElasticRuntime,
    MeshPolicy,
    RuntimeConfig,
    SilentCorruption,
    read_events,
)
from elastic_runtime.core.compare import compare_states  # noqa: E402
from elastic_runtime.testing import FaultInjector  # noqa: E402
from elastic_runtime.testing.demo_model import demo_job  # noqa: E402

POLICY = MeshPolicy({"data": 4, "model": 2}, global_batch=96, slice_size=2)


def burn(until: float) -> None:
    """A CPU burner: the machine under load, as a shared host is."""
    while time.monotonic() < until:
        sum(i * i for i in range(10_000))


def run(steps: int, injector: FaultInjector | None = None) -> tuple[Any, list[Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        config = RuntimeConfig(run_dir=tmp, precompile=False, scale_up_poll_s=None, fingerprint_every=1, progress=False)
        runtime = ElasticRuntime(demo_job(), config=config, mesh_policy=POLICY)
        result = (injector.attach(runtime) if injector else runtime).run(steps)
        return result, read_events(f"{tmp}/events.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=20, help="fault-free runs, counted for false alarms")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--burners", type=int, default=0, help="CPU burner processes during the fault-free runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    burners = [
        multiprocessing.Process(target=burn, args=(time.monotonic() + 3600,), daemon=True) for _ in range(args.burners)
    ]
    for burner in burners:
        burner.start()
    alarms, reference = 0, None
    for _ in range(args.runs):
        result, events = run(args.steps)
        alarms += sum(isinstance(e, SilentCorruption) for e in events)
        reference = result.state
    for burner in burners:
        burner.terminate()
    out: dict[str, Any] = {"runs": args.runs, "steps": args.steps, "burners": args.burners, "false_alarms": alarms}
    out["load_average"] = os.getloadavg()
    for kind in ("transient", "persistent"):
        injector = FaultInjector().corrupt(args.steps // 2, device=6, persistent=kind == "persistent")
        result, events = run(args.steps, injector)
        found = [e for e in events if isinstance(e, SilentCorruption)]
        healed = [e for e in events if isinstance(e, CorruptionHealed)]
        out[kind] = {
            "injected_after_step": args.steps // 2,
            "detected_step": found[0].step if found else None,
            "suspects": list(found[0].suspects) if found else [],
            "healed": healed[-1].kind if healed else None,
            "evicted": list(healed[-1].evicted) if healed else [],
            "healed_s": round(healed[-1].seconds, 4) if healed else None,
            "reference": compare_states(result.state, reference, bitwise=kind == "transient"),
        }
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
