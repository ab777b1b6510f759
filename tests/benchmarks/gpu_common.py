"""What the GPU campaign's helpers share (tests/benchmarks/gpu_campaign.sh): the models at their sizes, the
mesh they run on, a bare jitted loop and the runtime's loop timed alike, and a deadline.

The helpers are ``gpu_steady.py``, ``gpu_resume.py``, ``gpu_tiers.py`` and ``gpu_maxtext.py``; each prints one
JSON object as its last line. Not collected by pytest.

Models: ``flax``, the example's decoder LM (examples/flax_lm.py) at ``tiny`` (the dry run on CPU), ``example``
(its own defaults: 91 state arrays, 5.4 MB) or ``large`` (d_model 1024, 4 layers, 256 tokens: about 0.6 GB of
state with adamw's moments); ``maxtext``, MaxText's llama2 and train step (examples/maxtext_lm.py, only where
``maxtext`` imports).

The mesh: on an accelerator every device on ``data`` (one GPU: a mesh of one); on CPU (the dry run) one device,
as on the one GPU, although the example's import makes 8 CPU devices: on more, the runtime would compile the
likely degraded meshes in the background, which the steady figures are not about.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # as every example and benchmark: before JAX starts its backend

import numpy as np  # noqa: E402

from elastic_runtime import ElasticRuntime, MeshPolicy, RuntimeConfig, StepCompleted, TrainJob, read_events  # noqa: E402
from elastic_runtime.core.compiler import StepCompiler  # noqa: E402
from elastic_runtime.core.initial import abstract_state, initial_program  # noqa: E402
from elastic_runtime.core.keys import with_key_data  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MODELS = ("flax", "maxtext")
SIZES = ("tiny", "example", "large")
# The flax example's ModelConfig fields and global batch per size; "example" is the example's own defaults.
FLAX_SIZES: dict[str, tuple[dict[str, int], int]] = {
    "tiny": ({"vocab": 64, "d_model": 32, "heads": 2, "layers": 1, "seq": 16}, 8),
    "example": ({}, 48),
    "large": ({"vocab": 4096, "d_model": 1024, "heads": 8, "layers": 4, "seq": 256}, 32),
}


@dataclass
class Model:
    """A job, the policy it runs under here, and what to call it in the results."""

    name: str
    size: str
    job: TrainJob
    policy: MeshPolicy
    state_mb: float


class Deadline:
    """Seconds left of a helper's budget: it starts no new measurement it cannot finish, and reports what it has
    rather than being killed by the campaign's ``timeout`` with nothing written."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        """Whether ``seconds`` more fit."""
        return self.left() >= seconds


def on_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


def data_axis(global_batch: int) -> int:
    """Devices on the ``data`` axis: every device that divides the global batch on an accelerator, one on CPU."""
    if on_cpu():
        return 1
    devices = len(jax.devices())
    return max(n for n in range(1, devices + 1) if global_batch % n == 0)


def flax_model(size: str) -> Model:
    sys.path.insert(0, str(EXAMPLES))
    import flax_lm  # examples/flax_lm.py

    overrides, global_batch = FLAX_SIZES[size]
    job = flax_lm.make_job(flax_lm.ModelConfig(**overrides), global_batch=global_batch)
    policy = MeshPolicy({"data": data_axis(global_batch), "model": 1}, global_batch=global_batch, slice_size=1)
    return Model("flax", size, job, policy, state_mb(job))


def maxtext_model(size: str, run_dir: str) -> Model:
    """MaxText's tiny llama2 of examples/maxtext_lm.py (its only size), on the mesh its config makes of this
    machine's devices; ``run_dir`` is MaxText's own output folder. Raises ImportError where MaxText is not
    installed."""
    sys.path.insert(0, str(EXAMPLES))
    import maxtext_lm  # examples/maxtext_lm.py (imports maxtext)

    job, policy = maxtext_lm.make_job(maxtext_lm.maxtext_config(1000, run_dir))
    # Its slices are 2 devices, for 8 CPU devices; on one GPU the slice is the device.
    policy = dataclasses.replace(policy, slice_size=min(policy.slice_size, len(jax.devices())))
    return Model("maxtext", size, job, policy, state_mb(job))


def build(model: str, size: str, scratch: str) -> Model:
    """``model`` at ``size``; ``scratch``: a folder for what the model itself writes (MaxText's output)."""
    return flax_model(size) if model == "flax" else maxtext_model(size, scratch)


def state_mb(job: TrainJob) -> float:
    """The state's size in MB (10^6 bytes), from its shapes alone."""

    def nbytes(leaf: Any) -> int:
        # A typed PRNG key's dtype (MaxText's state holds some) has no NumPy item size: count its key data.
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.eval_shape(jax.random.key_data, leaf)
        return int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize

    return round(sum(nbytes(x) for x in jax.tree.leaves(abstract_state(job))) / 1e6, 2)


def bare_loop(model: Model, *, steps: int, warmup: int, host_copy: bool = False) -> list[float]:
    """Seconds of each step after ``warmup`` of a plain loop around the runtime's own compiled step (with
    ``host_copy``, the one that also writes the state to host memory, into the previous copy's buffers as in the
    runtime): what a user writes without the runtime, the loss read back every step as a loop that logs it does.
    As ``bench_overhead.bare_loop``, for any job."""
    # Typed PRNG keys (MaxText's state) as their key data, as the runtime holds them: a host copy takes numbers only.
    job, _ = with_key_data(model.job)
    mesh = model.policy.fit(jax.devices())
    compiler = StepCompiler(job, abstract_state(job), job.data.batch(0), host_copy=host_copy)
    step = compiler.get(mesh)
    state = initial_program(job, compiler.state_shardings(mesh), mesh)()
    batch_sharding = compiler.batch_shardings(mesh)
    spare: Any = None
    times = []
    started = time.perf_counter()
    for position in range(warmup + steps):
        batch = jax.device_put(job.data.batch(position), batch_sharding)
        if host_copy:
            buffers = compiler.fresh_buffers(mesh) if spare is None else spare
            state, metrics, *host = step(state, batch, buffers)
        else:
            state, metrics, *host = step(state, batch)
        loss = job.loss(metrics)
        if loss is not None:
            float(np.asarray(loss))
        jax.block_until_ready((state, host))
        spare = host[0] if host else None
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
    del state, spare
    return times[warmup:]


def runtime_loop(model: Model, *, steps: int, warmup: int, run_dir: str, **options: Any) -> dict[str, Any]:
    """``ElasticRuntime`` on the model with ``options`` (RuntimeConfig fields): the intervals between committed
    steps after ``warmup`` (everything between two steps counts) and the RAM snapshots taken in them."""
    config = RuntimeConfig(run_dir=run_dir, **options)
    result = ElasticRuntime(model.job, config=config, mesh_policy=model.policy).run(warmup + steps)
    assert result.events_path is not None
    done = [e for e in read_events(result.events_path) if isinstance(e, StepCompleted)][max(warmup - 1, 0) :]
    del result  # the final state (a host copy), before the next contender takes memory
    return {"times": list(np.diff([e.mono_time for e in done])), "snapshots": sum(e.snapshot for e in done[1:])}


def ms(times: list[float]) -> dict[str, float]:
    """Median and mean of step times in seconds, as milliseconds."""
    return {"median_ms": round(float(np.median(times)) * 1e3, 3), "mean_ms": round(float(np.mean(times)) * 1e3, 3)}


def machine() -> dict[str, Any]:
    device = jax.devices()[0]
    return {"devices": len(jax.devices()), "device_kind": device.device_kind, "platform": device.platform}


def emit(result: dict[str, Any]) -> None:
    """The helper's result: one JSON line, the last it prints (the campaign records it)."""
    print(json.dumps(result, default=float), flush=True)
