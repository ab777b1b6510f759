"""A small decoder language model in flax nnx and optax, made elastic: a lost slice, a crash, a resume.

Run it (`pip install elastic-runtime[flax]`, already in `make test`'s environment):

    .venv/bin/python examples/flax_lm.py
        trains 200 steps on 8 virtual CPU devices, mesh data=4 x model=2 (a slice is 2 devices), loses slice 3
        at step 150, carries on with data=3, then trains a fault-free run and compares the two.
    .venv/bin/python examples/flax_lm.py --run-dir runs/lm --disk-every 10 --kill-at 35
        the process kills itself with SIGKILL at step 35 (a crash: nothing is flushed).
    .venv/bin/python examples/flax_lm.py --run-dir runs/lm --disk-every 10 --resume
        continues from the newest checkpoint any tier holds (step 30 here) and finishes the run.
    .venv/bin/elastic-runtime launch --nprocs 4 --slices 2 --spares 1 --fault kill:1@60 -- \
        .venv/bin/python examples/flax_lm.py --steps 120
        the same script as 4 worker processes (2 slices of 2), one killed at step 60 and replaced by the spare; the
        launch owns the run folder, the durable tier and the mesh (``under_launch()``), so the script leaves them.

The data is deterministic synthetic text (a noisy affine sequence mod the vocabulary, learnable), served as
a random-access dataset through ``IndexedBatches`` (``--grain``: wrapped in a grain ``MapDataset`` first).
The last line printed is a JSON summary: recovery time, how much of it waited for a compile, the lost steps,
and a digest of the final state (equal digests: bitwise equal states).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from elastic_runtime import (  # noqa: E402
    ElasticRuntime,
    IndexedBatches,
    MeshPolicy,
    RecoveryCompleted,
    RuntimeConfig,
    RuntimeContext,
    StateRestored,
    TrainJob,
    under_launch,
)
from elastic_runtime.core.compare import compare_states  # noqa: E402
from elastic_runtime.testing import FaultInjector  # noqa: E402


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    layers: int = 2
    seq: int = 64


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        d = cfg.d_model
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        # No attention biases (as in LLaMA): a key bias has an exactly zero gradient, and Adam scales the
        # rounding noise of a zero gradient up to full-size updates, which differ between any two meshes.
        self.attn = nnx.MultiHeadAttention(num_heads=cfg.heads, in_features=d, decode=False, use_bias=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class DecoderLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg.seq, cfg.d_model)) * 0.02)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


class SyntheticText:
    """Record ``i``: ``seq + 1`` tokens where each is ``(5 * previous + 3) % vocab``, one in ten replaced by a
    random token. The same ``i`` always gives the same record (its RNG is seeded by ``i``)."""

    def __init__(self, cfg: ModelConfig, records: int = 1 << 16, seed: int = 0) -> None:
        self.cfg, self.records, self.seed = cfg, records, seed

    def __len__(self) -> int:
        return self.records

    def __getitem__(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        tokens = np.empty(self.cfg.seq + 1, np.int32)
        tokens[0] = rng.integers(self.cfg.vocab)
        noise = rng.random(self.cfg.seq) < 0.1
        random_tokens = rng.integers(self.cfg.vocab, size=self.cfg.seq)
        for t in range(self.cfg.seq):
            tokens[t + 1] = random_tokens[t] if noise[t] else (5 * tokens[t] + 3) % self.cfg.vocab
        return tokens


def state_specs(state: Any) -> Any:
    """The MLP's hidden dimension is split over ``model`` (Megatron style); the rest is replicated. Optimizer
    moments mirror the parameters' paths, so the same rule shards them alike."""

    def spec(path: tuple[Any, ...], leaf: Any) -> P:
        names = {getattr(key, "key", getattr(key, "name", None)) for key in path}
        if "up" in names:
            return P(None, "model") if np.ndim(leaf) == 2 else P("model")
        if "down" in names and np.ndim(leaf) == 2:
            return P("model", None)
        return P()

    return jax.tree_util.tree_map_with_path(spec, state)


def make_job(cfg: ModelConfig, *, global_batch: int, learning_rate: float = 3e-3, use_grain: bool = False) -> TrainJob:
    graphdef, params = nnx.split(DecoderLM(cfg, nnx.Rngs(0)), nnx.Param)
    params = jax.device_get(nnx.to_pure_dict(params))
    optimizer = optax.adamw(learning_rate)
    initial = {"params": params, "opt": jax.device_get(optimizer.init(params))}

    def step(state: Any, tokens: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        def loss_fn(params: Any) -> jax.Array:
            logits = nnx.merge(graphdef, params)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = optimizer.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}

    records: Any = SyntheticText(cfg)
    if use_grain:
        import grain

        records = grain.MapDataset.source(records)
    return TrainJob(
        init=lambda: initial,
        step=step,
        data=IndexedBatches(records, global_batch),
        state_specs=state_specs(initial),
        batch_spec=P("data"),
    )


def digest(state: Any) -> str:
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        sha.update(np.ascontiguousarray(leaf).tobytes())
    return sha.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lose-slice-at", type=int, default=150, help="lose a slice at this step (0: never)")
    parser.add_argument("--lose-slice", type=int, default=3, help="which slice of 2 devices (0-3)")
    parser.add_argument("--kill-at", type=int, default=0, help="SIGKILL this process at this step (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of --run-dir")
    parser.add_argument("--run-dir", default=None, help="default: runs/flax-lm-<time>")
    parser.add_argument("--disk-every", type=int, default=100, help="steps between disk checkpoints")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--grain", action="store_true", help="serve the records through a grain MapDataset")
    parser.add_argument("--no-reference", action="store_true", help="skip the fault-free run and its comparison")
    parser.add_argument(
        "--fingerprint-every",
        type=int,
        default=None,
        help="compare the state's replicas every N steps (silent data corruption; under launch: 1 or 0)",
    )
    parser.add_argument(
        "--corrupt-at", type=int, default=0, help="flip a bit of device 6's copy of the state after this step"
    )
    args = parser.parse_args()

    cfg = ModelConfig(d_model=args.d_model)
    job = make_job(cfg, global_batch=args.global_batch, use_grain=args.grain)
    # Under `elastic-runtime launch` the launch owns the run folder, the durable tier and the mesh: set here they
    # would be refused (the run folder) or not apply (the others), so the script sets them when embedded only.
    launched = under_launch()
    policy = None if launched else MeshPolicy({"data": 4, "model": 2}, global_batch=args.global_batch, slice_size=2)
    run_dir = args.run_dir or ("" if launched else time.strftime("runs/flax-lm-%Y%m%d-%H%M%S"))
    every = args.fingerprint_every
    if launched:  # --run-dir, if given, must be the launch's (it says so if not)
        config = RuntimeConfig(run_dir=args.run_dir, fingerprint_every=every)
    else:
        checkpoints = os.path.join(run_dir, "checkpoints")
        config = RuntimeConfig(
            run_dir=run_dir, checkpoint_dir=checkpoints, disk_every=args.disk_every, fingerprint_every=every
        )
    injector = FaultInjector()
    if args.corrupt_at:  # embedded; under launch a worker's own fault does it: `launch --fault corrupt:1@STEP`
        injector.corrupt(args.corrupt_at, device=6)
    if args.lose_slice_at:
        injector.lose_slice(at_step=args.lose_slice_at, slice_index=args.lose_slice, slice_size=2)
    runtime = injector.attach(ElasticRuntime(job, config=config, mesh_policy=policy))
    summary: dict[str, Any] = {"run_dir": run_dir}

    @runtime.on(RecoveryCompleted)
    async def recovered(event: RecoveryCompleted, ctx: RuntimeContext) -> None:
        print(
            f"recovered from {event.cause} in {event.recovery_s:.3f} s ({event.compile_wait_s:.3f} s waiting "
            f"for a compile), lost {event.lost_steps} step(s)"
        )
        summary.update(recovery_s=event.recovery_s, compile_wait_s=event.compile_wait_s, lost_steps=event.lost_steps)

    @runtime.on(StateRestored)
    async def restored(event: StateRestored, ctx: RuntimeContext) -> None:
        summary.setdefault("restored", []).append({"step": event.step, "source": event.restored_from})

    if args.kill_at:

        def crash(step: int) -> None:
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        runtime.at_step_boundary(crash)

    started = time.perf_counter()
    result = runtime.run(steps=args.steps, resume=args.resume, gather=True)  # the lead reports on the state
    if result.state is None:  # a worker of `elastic-runtime launch` other than the lead: the lead reports
        return
    summary.update(
        step=result.step,
        loss=result.loss,
        seconds=round(time.perf_counter() - started, 3),
        meshes=result.mesh_history,
        digest=digest(result.state),
    )
    if not args.no_reference and result.mode == "embedded":  # under launch, the launch's --result is compared
        reference = ElasticRuntime(job, config=RuntimeConfig(precompile=False), mesh_policy=policy).run(args.steps)
        summary["reference"] = compare_states(result.state, reference.state, bitwise=False)
        summary["reference_digest"] = digest(reference.state)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
