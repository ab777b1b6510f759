#!/usr/bin/env bash
# The GPU checks, as one short script for a lent GPU machine whose python3 already has jax with CUDA and
# orbax-checkpoint: that the fused host copy writes into the donated buffers on a GPU too, issue 3's
# blocking time per save against Orbax async with a state of several GB, and issue 2's steady-state
# overhead against the bare JAX loop, on the demo model and on a scaled-up one.
# Our other dependencies travel as wheels in .whl/ (git-ignored), fetched on the machine that sends them:
#
#     .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#         $(.venv/bin/pip freeze | grep -i -E '^(msgspec|tenacity|google|grpc|proto|pyasn1|opentelemetry)') \
#         $(.venv/bin/pip freeze | grep -i -E '^(flax|optax|chex|treescope|msgpack|rich|markdown-it|mdurl|pygments|toolz)=') \
#         cryptography cffi pycparser
#
# Figures go to $OUT (default ./gpu-out); every part has its own time limit, so one that hangs cannot take
# the others with it.
#
#     OUT=/tmp/gpu bash tests/benchmarks/gpu_check.sh
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

part() {  # part NAME SECONDS COMMAND...: run one check under a time limit, its output to $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local started=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.txt" | grep -v -i warning | tail -15
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - started))s"
}

nvidia-smi -L
part smoke 90 python3 -c 'import jax, orbax.checkpoint as ocp, elastic_runtime, elastic_runtime.core.snapshot
print(jax.__version__, ocp.__version__, jax.devices())'
part fused_copy_donation 120 python3 -m pytest -q -p no:cacheprovider tests/test_ram.py -k fused_step
part checkpoint_4gib 180 python3 tests/benchmarks/bench_checkpoint.py --mb 4096 --repeats 3 --blocking-only --dir /tmp/ckpt
part overhead_demo_model 150 python3 tests/benchmarks/bench_overhead.py --steps 200 --repeats 8
# The flax example's recovery needs 8 devices to lose a slice of: the machine's 16 cores as 8 CPU devices
# (JAX_PLATFORMS=cpu), where compiles take what they take on a larger host than this VM.
part flax_recovery_16_cores 300 env JAX_PLATFORMS=cpu python3 tests/benchmarks/bench_flax_recovery.py --repeats 2
part overhead_large_model 150 python3 tests/benchmarks/bench_overhead.py --steps 200 --repeats 5 \
    --batch 256 --features 1024 --hidden 16384
