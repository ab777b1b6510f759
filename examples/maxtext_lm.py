"""MaxText's own llama2 decoder, config system, optimizer and train_step, made elastic: a lost slice in one
process, a killed worker under ``elastic-runtime launch``.

Install (Python >= 3.12; ``make maxtext`` builds ``.venv-maxtext`` from ``constraints/maxtext.txt``):

    python3.13 -m venv .venv-maxtext && .venv-maxtext/bin/pip install -r constraints/maxtext.txt -e '.[flax]'

Run it:

    .venv-maxtext/bin/python examples/maxtext_lm.py --json
        one process, 8 virtual CPU devices, MaxText's mesh data=4 x fsdp=2 (a slice is 2 devices): trains 200
        steps, loses slice 3 at step 150, carries on with data=3, then trains a fault-free run (in a process
        of its own: --save-state / --compare-state) and compares the two.
    .venv-maxtext/bin/elastic-runtime launch --nprocs 4 --slices 2 --fault kill:1@25 --result runs/mt/final \\
            --start-timeout 600 --form-timeout 600 -- .venv-maxtext/bin/python examples/maxtext_lm.py --steps 40
        four worker processes of 2 CPU devices, two slices: ``data`` (MaxText's replica axis) across the slices,
        ``fsdp`` over the 4 devices inside one; worker 1 is killed at step 25 and replaced.
    .venv-maxtext/bin/elastic-runtime launch --nprocs 4 --slices 1 --durable runs/mt/durable ... (same script)
        one slice: the lost worker's shards come from the durable checkpoints.
    .venv-maxtext/bin/python examples/maxtext_lm.py --digest-of runs/mt/final
        the digest of a final state ``--result`` committed (equal digests: bitwise equal states).

The model and its step are MaxText's, unchanged: ``pyconfig.initialize`` over ``base.yml`` with a tiny model's
overrides, ``model_creation_utils.create_nnx_abstract_model``, ``train_utils.create_training_optimizer``
(AdamW), ``TrainStateNNX`` and ``maxtext.trainers.pre_train.train.train_step``. A MaxText model keeps the
concrete ``Mesh`` it was built for, so the job builds one per mesh (``TrainJob.step_for_mesh``). The state is
``TrainStateNNX``'s as a pure dict (its typed PRNG keys included); the data are deterministic synthetic tokens
in MaxText's batch layout, through ``IndexedBatches``. The last line printed is a JSON summary (``--json``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backend (a launched worker sets its own)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from flax.core.spmd import logical_axis_rules  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# MaxText's trainer pieces (importing them starts no backend: `import elastic_runtime` below still sets XLA's flags
# first).
from maxtext.common import train_state_nnx  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.trainers.pre_train import train as maxtext_train  # noqa: E402
from maxtext.utils import maxtext_utils, model_creation_utils, sharding, train_utils  # noqa: E402

from elastic_runtime import (  # noqa: E402
    ConfigError,
    ElasticRuntime,
    IndexedBatches,
    MeshPolicy,
    ProcessMesh,
    RecoveryCompleted,
    RuntimeConfig,
    RuntimeContext,
    TrainJob,
    under_launch,
)
from elastic_runtime.core.compare import compare_states  # noqa: E402
from elastic_runtime.testing import FaultInjector  # noqa: E402

SLICE_SIZE = 2  # devices per failure domain in one process

# A tiny llama2: the overrides of base.yml (MaxText's own keys, as on its command line).
TINY = {
    "decoder_block": "llama2",
    "base_emb_dim": 256,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 4,
    "head_dim": 64,
    "base_mlp_dim": 512,
    "base_num_decoder_layers": 2,
    "vocab_size": 512,
    "max_target_length": 64,
    "per_device_batch_size": 3,
    "dtype": "float32",
    "attention": "dot_product",
    # Layers unrolled, not scanned: on CPU, XLA ran the step's independent all-reduce (the token count,
    # total_weights) beside the all-gathers inside the scanned layers' loop in a different order on different
    # devices and the step hung for good (docs/maxtext.md, "The hang, found"). On TPU and GPU keep MaxText's default.
    "scan_layers": False,
    "learning_rate": 3e-3,
    "hardware": "cpu",
    "ici_data_parallelism": 4,
    "ici_fsdp_parallelism": 2,
    "dcn_data_parallelism": 1,
    "dataset_type": "synthetic",  # MaxText's own pipeline is not used: the runtime serves the batches
    "enable_checkpointing": False,  # the runtime checkpoints
    "skip_jax_distributed_system": True,  # the runtime forms the group under launch
    "log_config": False,
    "enable_goodput_recording": False,
    "monitor_goodput": False,
}


def maxtext_config(steps: int, run_dir: str, **overrides: Any) -> Any:
    """MaxText's config: ``base.yml`` with the tiny model's overrides (``overrides`` on top)."""
    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    keys = {**TINY, "steps": steps, "run_name": "elastic", "base_output_directory": os.path.abspath(run_dir)}
    return pyconfig.initialize(["", base], **(keys | overrides))


class SyntheticTokens:
    """Record ``i``: MaxText's batch fields for one sequence of ``seq + 1`` tokens where each is
    ``(5 * previous + 3) % vocab``, one in ten replaced by a random token (learnable, not trivial). The same
    ``i`` always gives the same record (its RNG is seeded by ``i``)."""

    def __init__(self, vocab: int, seq: int, records: int = 1 << 16, seed: int = 0) -> None:
        self.vocab, self.seq, self.records, self.seed = vocab, seq, records, seed

    def __len__(self) -> int:
        return self.records

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        tokens = np.empty(self.seq + 1, np.int32)
        tokens[0] = rng.integers(self.vocab)
        noise = rng.random(self.seq) < 0.1
        random_tokens = rng.integers(self.vocab, size=self.seq)
        for t in range(self.seq):
            tokens[t + 1] = random_tokens[t] if noise[t] else (5 * tokens[t] + 3) % self.vocab
        positions = np.arange(self.seq, dtype=np.int32)
        ones = np.ones(self.seq, np.int32)
        return {
            "inputs": tokens[:-1],
            "inputs_position": positions,
            "inputs_segmentation": ones,
            "targets": tokens[1:],
            "targets_position": positions,
            "targets_segmentation": ones,
        }


class MaxTextOnMesh:
    """MaxText's model, optimizer and train state built for one concrete mesh, as its ``setup_train_loop``
    builds them."""

    def __init__(self, config: Any, mesh: Mesh) -> None:
        self.config, self.mesh = config, mesh
        create_model, abstract_model = model_creation_utils.create_nnx_abstract_model(config, mesh)
        _, tx = train_utils.create_training_optimizer(config, abstract_model, mesh=mesh)

        def init_state() -> Any:
            model = create_model()
            return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

        self.init_state = init_state
        _, _, self.state_shardings = maxtext_utils.get_abstract_state_nnx(config, mesh, init_state, True)
        with logical_axis_rules(config.logical_axis_rules):
            self.graphdef, self.template = nnx.split(nnx.eval_shape(init_state))
            self.params_shardings: Any = nnx.split(self.state_shardings.model, nnx.Param, ...)[1]

    def to_nnx(self, pure: dict[str, Any]) -> Any:
        """The runtime's pure-dict state as the ``nnx.State`` MaxText's ``train_step`` takes."""
        state = jax.tree.map(lambda leaf: leaf, self.template)  # a fresh State of the same structure
        nnx.replace_by_pure_dict(state, pure)
        return state

    def specs(self) -> Any:
        """The state's PartitionSpecs (MaxText's logical rules resolved on this mesh), as a pure dict."""
        return nnx.to_pure_dict(jax.tree.map(lambda s: s.spec, self.state_shardings))

    def batch_spec(self) -> P:
        return sharding.get_input_data_sharding(self.config, self.mesh).spec


def single_device_mesh(config: Any) -> Mesh:
    """MaxText's axes, each of size 1, on the first local device: where the initial state is built."""
    return Mesh(np.array(jax.local_devices()[:1]).reshape((1,) * len(config.mesh_axes)), tuple(config.mesh_axes))


def make_job(config: Any, *, global_batch: int | None = None) -> tuple[TrainJob, MeshPolicy]:
    """The elastic job of MaxText's ``train_step`` and the one-process mesh policy of ``config``'s mesh.

    ``global_batch``: rows per batch the runtime hands out (default MaxText's own ``global_batch_size_to_train_on``).

    Raises:
        ConfigError: ``global_batch`` differs from what MaxText's step consumes, or gradient accumulation is on.
    """
    consumed = config.micro_batch_size_to_train_on
    global_batch = config.global_batch_size_to_train_on if global_batch is None else global_batch
    if config.gradient_accumulation_steps != 1:
        raise ConfigError("maxtext_lm: gradient_accumulation_steps > 1 is not supported by this example yet")
    if global_batch != consumed:
        # MaxText's loss_fn cuts every batch to micro_batch_size_to_train_on rows: more would be dropped
        # silently, fewer would not fill its shapes.
        raise ConfigError(
            f"maxtext_lm: the runtime would hand out batches of {global_batch} rows, but MaxText's train_step "
            f"consumes micro_batch_size_to_train_on={consumed} (per_device_batch_size "
            f"{config.per_device_batch_size} x {config.num_target_devices} devices); make them equal"
        )
    full_mesh = maxtext_utils.get_mesh_from_config(config)  # the config's mesh on this process's devices
    shape = {str(name): int(size) for name, size in full_mesh.shape.items()}
    layout = MaxTextOnMesh(config, full_mesh)
    state_specs, batch_spec = layout.specs(), layout.batch_spec()
    # Specs are names, valid on any mesh with these axes: the runtime places the state on each mesh with them.
    del layout, full_mesh

    def init() -> Any:
        # Built on one device of whatever backend is current (a launched worker drops the script's backend
        # and its meshes); the runtime places it on the mesh.
        on_one = MaxTextOnMesh(config, single_device_mesh(config))
        with logical_axis_rules(config.logical_axis_rules):
            state = jax.jit(lambda: nnx.state(on_one.init_state()))()
        return nnx.to_pure_dict(state)

    def step_for_mesh(mesh: Mesh) -> Any:
        on_mesh = MaxTextOnMesh(config, mesh)

        def step(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, dict[str, Any]]:
            rows = batch["inputs"].shape[0]
            if rows != consumed:
                raise ConfigError(
                    f"maxtext_lm: a batch of {rows} rows reached MaxText's train_step, which consumes "
                    f"micro_batch_size_to_train_on={consumed}"
                )
            with logical_axis_rules(config.logical_axis_rules):  # the runtime has entered jax.set_mesh(mesh)
                new_state, metrics = maxtext_train.train_step(
                    on_mesh.graphdef,
                    config,
                    on_mesh.state_shardings,
                    on_mesh.params_shardings,
                    on_mesh.to_nnx(state),
                    dict(batch),
                )
            return nnx.to_pure_dict(new_state), metrics

        return step

    job = TrainJob(
        init=init,
        step=None,
        step_for_mesh=step_for_mesh,
        data=IndexedBatches(SyntheticTokens(config.vocab_size, config.max_target_length), global_batch),
        state_specs=state_specs,
        batch_spec=batch_spec,
        loss_key=("scalar", "learning/loss"),
        # Under launch: MaxText's axes, data across the slices, fsdp over each slice's devices, the rest 1.
        process_mesh=ProcessMesh({name: -1 if name == "fsdp" else 1 for name in config.mesh_axes}, replica_axis="data"),
    )
    policy = MeshPolicy(shape, global_batch=global_batch, slice_size=SLICE_SIZE, batch_axis="data")
    return job, policy


def digest(state: Any) -> str:
    """A hash of every leaf's bytes (a PRNG key by its key data)."""
    sha = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        sha.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return sha.hexdigest()[:16]


def comparable(state: Any) -> Any:
    """``state`` with its PRNG keys as key data, for ``compare_states``."""

    def plain(leaf: Any) -> Any:
        if jax.dtypes.issubdtype(getattr(leaf, "dtype", np.float32), jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(leaf))
        return np.asarray(leaf)

    return jax.tree.map(plain, state)


def final_state(folder: str) -> Any:
    """The state ``elastic-runtime launch --result FOLDER`` committed."""
    from elastic_runtime.storage.disk import DiskTier

    checkpoint = DiskTier(Path(folder)).latest(None)
    if checkpoint is None:
        raise SystemExit(f"maxtext_lm: no final state in {folder}")
    return checkpoint.tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lose-slice-at", type=int, default=150, help="lose a slice at this step (0: never)")
    parser.add_argument(
        "--lose-slice", type=int, default=3, help="which (0-3); the background compiles go in slice order"
    )
    parser.add_argument("--run-dir", default=None, help="default: runs/maxtext-lm-<time>")
    parser.add_argument("--global-batch", type=int, default=None, help="default: MaxText's global batch")
    parser.add_argument("--no-precompile", action="store_true", help="no background compiles of degraded meshes")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the fault-free run (another process) and its comparison"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one line of JSON, last")
    parser.add_argument(
        "--fingerprint-every",
        type=int,
        default=None,
        help="compare the state's replicas every N steps (silent data corruption; under launch: 1 or 0)",
    )
    parser.add_argument(
        "--corrupt-at", type=int, default=0, help="flip a bit of device 6's copy of the state after this step"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 unless 0 steps lost and within 1e-5")
    parser.add_argument("--digest-of", default=None, help="print the digest of a --result folder and exit")
    parser.add_argument("--compare", default=None, help="with --digest-of: a second --result folder to compare")
    parser.add_argument("--save-state", default=None, help="write the final state's leaves to this .npz file")
    parser.add_argument("--compare-state", default=None, help="compare the final state with a --save-state file")
    args = parser.parse_args()

    if args.digest_of:
        state = final_state(args.digest_of)
        summary: dict[str, Any] = {"digest": digest(state)}
        if args.compare:
            other = final_state(args.compare)
            summary.update(reference_digest=digest(other), reference=compare_states(state, other, bitwise=True))
        print(json.dumps(summary))
        return

    # Under `elastic-runtime launch` the launch owns the run folder, the durable tier and the mesh: set here they
    # would be refused (the run folder) or not apply (the others), so the script sets them when embedded only.
    launched = under_launch()
    run_dir = args.run_dir or ("" if launched else time.strftime("runs/maxtext-lm-%Y%m%d-%H%M%S"))
    # MaxText's own output folder (its checkpoints are off: the runtime checkpoints).
    config = maxtext_config(args.steps, run_dir or tempfile.mkdtemp(prefix="maxtext-lm-"))
    job, policy = make_job(config, global_batch=args.global_batch)
    precompile, every = not args.no_precompile, args.fingerprint_every
    if launched:  # --run-dir, if given, must be the launch's (it says so if not)
        runtime_config = RuntimeConfig(run_dir=args.run_dir, precompile=precompile, fingerprint_every=every)
    else:
        checkpoints = os.path.join(run_dir, "checkpoints")
        runtime_config = RuntimeConfig(
            run_dir=run_dir, checkpoint_dir=checkpoints, precompile=precompile, fingerprint_every=every
        )
    injector = FaultInjector()
    if args.corrupt_at:  # embedded; under launch a worker's own fault does it: `launch --fault corrupt:1@STEP`
        injector.corrupt(args.corrupt_at, device=6)
    if args.lose_slice_at:
        injector.lose_slice(at_step=args.lose_slice_at, slice_index=args.lose_slice, slice_size=SLICE_SIZE)
    # Under `elastic-runtime launch` run() becomes this process's worker (the injector and policy are for one
    # process: the controller injects --fault, the group's mesh is job.process_mesh); it returns once the group
    # finished, the final state in the lead process only.
    runtime = injector.attach(ElasticRuntime(job, config=runtime_config, mesh_policy=None if launched else policy))
    summary = {"run_dir": run_dir, "recovery_s": None, "compile_wait_s": None, "lost_steps": None}

    @runtime.on(RecoveryCompleted)
    async def recovered(event: RecoveryCompleted, ctx: RuntimeContext) -> None:
        print(
            f"recovered from {event.cause} in {event.recovery_s:.3f} s ({event.compile_wait_s:.3f} s waiting "
            f"for a compile), lost {event.lost_steps} step(s), on {event.mesh_shape}",
            flush=True,
        )
        summary.update(recovery_s=event.recovery_s, compile_wait_s=event.compile_wait_s, lost_steps=event.lost_steps)

    started = time.perf_counter()
    result = runtime.run(args.steps, gather=True)  # the lead reports on the state
    if result.state is None:  # a worker of `elastic-runtime launch` other than the lead: the lead reports
        return
    summary.update(
        step=result.step,
        loss=result.loss,
        seconds=round(time.perf_counter() - started, 3),
        meshes=result.mesh_history,
        digest=digest(result.state),
    )
    ok = not args.lose_slice_at or summary["lost_steps"] == 0
    if args.save_state:
        np.savez(args.save_state, *jax.tree.leaves(comparable(result.state)))
    if not args.no_reference and not args.compare_state and result.mode == "embedded":
        # The fault-free run of the same length, in a process of its own: a second runtime in this process
        # hung twice in an XLA CPU collective (docs/maxtext.md, "Known issue").
        reference_dir = os.path.join(run_dir, "reference")
        os.makedirs(reference_dir, exist_ok=True)
        args.compare_state = os.path.join(reference_dir, "state.npz")
        command = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--lose-slice-at", "0"]
        command += ["--no-reference", "--no-precompile", "--json", "--run-dir", reference_dir]
        command += ["--save-state", args.compare_state]
        if args.global_batch is not None:
            command += ["--global-batch", str(args.global_batch)]
        finished = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        summary["reference_digest"] = json.loads(finished.stdout.strip().splitlines()[-1])["digest"]
    if args.compare_state:
        with np.load(args.compare_state) as saved:
            leaves = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        compared = compare_states(jax.tree.leaves(comparable(result.state)), leaves, bitwise=False, rtol=1e-5)
        summary.update(max_rel_error=compared["max_rel_error"], reference=compared)
        ok = ok and compared["match"]
    if args.json:
        print(json.dumps(summary))
    else:
        print(summary)
    if args.check and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
