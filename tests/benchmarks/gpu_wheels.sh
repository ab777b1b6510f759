#!/usr/bin/env bash
# Fetches, on this machine, the wheels of what the GPU host's python3 lacks for tests/benchmarks/gpu_campaign.sh,
# into .whl/ (git-ignored), for the device tool to carry (carry [".whl"]); gpu_campaign.sh installs them there
# with pip --no-index --no-deps --target. The host (docs: /work/.library/device/KINDS.md) has Python 3.12, jax with
# CUDA, flax, optax, orbax-checkpoint, anyio, tensorstore, numpy and pytest, and nothing can be downloaded there.
#
#     bash tests/benchmarks/gpu_wheels.sh [--python-version 3.12] [--no-flax]
#
# What `import elastic_runtime` and the campaign's parts need beyond that: msgspec, tenacity, google-crc32c (none
# of them has a dependency; google-cloud-storage and google-cloud-pubsub load only for GCS and Pub/Sub, which the
# campaign does not use). Versions: the ones .venv was tested with (pip freeze), where .venv exists; else these
# pins, which pyproject.toml admits. And flax 0.12.12 (pure Python; its needs are all on the host), in case the
# host's own does not import with its jax: .venv's flax 0.12.8 does not with jax 0.11 (no hijax.HiPrimitive there);
# 0.12.12 (which asks for jax >= 0.11.1) ran the campaign's dry run with jax 0.11.2 on Python 3.12. Installed into
# the folder that comes first on PYTHONPATH, it is the one the parts import.
set -eu
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
python_version=3.12
flax=flax==0.12.12
while [ $# -gt 0 ]; do
    case $1 in
        --python-version) python_version=$2; shift ;;
        --no-flax) flax="" ;;
        *) echo "gpu_wheels.sh: unknown argument $1 (--python-version X.Y, --no-flax)" >&2; exit 2 ;;
    esac
    shift
done

declare -A pins=([msgspec]=0.23.0 [tenacity]=9.2.1 [google-crc32c]=1.9.0)
if [ -x .venv/bin/python ]; then
    frozen=$(.venv/bin/python -m pip freeze 2>/dev/null || true)
    for name in "${!pins[@]}"; do
        version=$(printf '%s\n' "$frozen" | grep -i -E "^${name}==" | cut -d= -f3 || true)
        [ -n "$version" ] && pins[$name]=$version
    done
fi
requirements=(${flax:+"$flax"})
for name in "${!pins[@]}"; do requirements+=("$name==${pins[$name]}"); done

rm -rf .whl
mkdir -p .whl
# manylinux tags as the device README lists them (pip matches N exactly); x86-64, the host's processor.
python3 -m pip download --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${requirements[@]}"
ls -l .whl
du -sh .whl
