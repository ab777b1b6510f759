#!/usr/bin/env bash
# The prepared campaign for the first GPU host lent to this project (issue 65): one script, every part under its
# own time budget, every result as JSON and one Markdown table under $OUT, within 8 minutes on a host with one GPU
# (H100 80 GB or H200 141 GB), 16 cores and 128 GiB, whose python3 has jax with CUDA, flax, optax and
# orbax-checkpoint. `--dry-run` runs the same parts on CPU with tiny sizes (tests/test_gpu_campaign.py, in
# `make test`), so the script is known to work before a host is.
#
#     OUT=DIR bash tests/benchmarks/gpu_campaign.sh                 on the GPU host (OUT defaults to ./gpu-out)
#     bash tests/benchmarks/gpu_campaign.sh --dry-run               here, on CPU (OUT defaults to a new temp folder)
#     OUT=DIR bash tests/benchmarks/gpu_campaign.sh --only resume tiers     some parts only (a rerun)
#
# Parts (budgets in seconds on the host; each writes $OUT/<part>.json, whose `status` is ok, skipped, failed or
# timeout, with the part's JSON `result` and the tail of its stderr; a part that fails or runs out of time is
# recorded and the next one runs):
#
#   env            25   the machine, the packages, the import of elastic_runtime (gpu_report.py env)
#   compile_ahead 120   the flax example on 8 CPU devices with the host's 16 cores: LikelyMeshesReady against
#                       1.5x of (likely meshes x one compile / cores), a slice lost after it recovering with no
#                       compile (bench_flax_recovery.py --repeats 3 --json, through gpu_compile_ahead.py)
#   steady         60   the flax example on the GPU: the runtime at defaults against the bare jitted loop, paired,
#                       and the RAM snapshot's cost at its size (gpu_steady.py)
#   resume         90   the flax example killed with kill -9, resume=True from /dev/shm and from disk, against a
#                       plain Orbax restart from disk, each with an empty and a filled compilation cache
#                       (gpu_resume.py)
#   maxtext        30   the same two for MaxText's model, where `maxtext` imports (gpu_maxtext.py): skipped
#                       otherwise, "MaxText not importable"
#   tiers          85   1 GB and 8 GB of state: the step's blocking time with a snapshot every step and at the
#                       Young-Daly cadence, a disk commit's bandwidth against a raw write (gpu_tiers.py)
#   fingerprint    40   the state fingerprint's cost per step: fingerprint_every=1 against the defaults (as
#                       often as costs 1% of a step); GPU_CAMPAIGN_FINGERPRINT_CONFIG='{"FIELD": VALUE}' (or the default
#                       below) makes it gpu_steady.py --config against the defaults
#                ----
#   sum           450   + the wheels' install and the table (~10 s); no part starts once it could end after 470 s
#
# The project's .venv stays behind (Python 3.11, CPU jax, 600+ MB; the host's python3 is 3.12 with CUDA jax): the
# packages the host lacks travel as wheels in .whl/ (git-ignored), which tests/benchmarks/gpu_wheels.sh fetches
# here; this script installs them with pip --no-index --target into a temporary folder and puts the repository
# root (the `elastic_runtime` link) first on PYTHONPATH. On the device tool: carry [".whl"].
#
# Files under $OUT: the 7 parts' JSON and summary.md (8 files: the device tool brings back at most 8).
set -u

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
bench=tests/benchmarks
ALL_PARTS="env compile_ahead steady resume maxtext tiers fingerprint"

dry=0
with_wheels=0
only=""
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry=1 ;;
        --with-wheels) with_wheels=1 ;;  # the dry run too installs .whl/ (to try the wheels with a Python 3.12 here)
        --only)
            shift
            while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do only="$only $1"; shift; done
            continue
            ;;
        -h | --help) sed -n '2,/^set -u/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_campaign.sh: unknown argument $1 (--dry-run, --with-wheels, --only PART...)" >&2; exit 2 ;;
    esac
    shift
done
for part in $only; do
    case " $ALL_PARTS " in *" $part "*) ;; *) echo "gpu_campaign.sh: no part $part (parts: $ALL_PARTS)" >&2; exit 2 ;; esac
done
parts=${only:-$ALL_PARTS}

if [ $dry = 1 ]; then
    OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-campaign-XXXXXX")}
    if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
    export JAX_PLATFORMS=cpu GPU_CAMPAIGN_DRY_RUN=1
    total=900  # the dry run is bounded by its test's timeout instead
else
    OUT=${OUT:-gpu-out}
    total=470
fi
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-campaign-work-XXXXXX")  # the parts' raw output: not under $OUT (8 files)
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# The wheels of what the host's python3 lacks (msgspec, tenacity, google-crc32c: tests/benchmarks/gpu_wheels.sh).
site_dir=""
if [ -d .whl ] && compgen -G '.whl/*.whl' >/dev/null && { [ $dry = 0 ] || [ $with_wheels = 1 ]; }; then
    site_dir=${TMPDIR:-/tmp}/gpu-campaign-site
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site_dir" .whl/*.whl; then
        GPU_CAMPAIGN_WHEELS=$(cd .whl && ls -- *.whl | tr '\n' ' ')
        export GPU_CAMPAIGN_WHEELS
    else
        echo "gpu_campaign.sh: installing .whl/ failed; the parts run without them" >&2
        site_dir=""
    fi
fi
export PYTHONPATH="$root${site_dir:+:$site_dir}${PYTHONPATH:+:$PYTHONPATH}"

dry_flag=()
[ $dry = 1 ] && dry_flag=(--dry-run)
began=$(date +%s.%N)
failed=0

elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# Where a part's helper stops starting new work: its budget less a margin for writing its result.
deadline() { echo $(($1 - ($1 / 8 > 8 ? $1 / 8 : 8))); }

run_part() {  # run_part NAME BUDGET COMMAND...: the command under `timeout`, its result recorded in $OUT/NAME.json
    local name=$1 budget=$2
    shift 2
    local so_far
    so_far=$(elapsed "$began")
    if awk -v s="$so_far" -v b="$budget" -v t="$total" 'BEGIN { exit !(s + b > t) }'; then
        "$PY" $bench/gpu_report.py skip --out "$OUT" --part "$name" --budget "$budget" "${dry_flag[@]}" \
            --reason "not started: ${so_far} s gone, its ${budget} s would end past the campaign's ${total} s"
        failed=1  # not measured: as much a miss as a failure
        return
    fi
    echo "== $name (budget ${budget} s): $*"
    local started rc
    started=$(date +%s.%N)
    timeout -k 3 "$budget" "$@" >"$work/$name.out" 2>"$work/$name.err"
    rc=$?
    "$PY" $bench/gpu_report.py record --out "$OUT" --part "$name" --budget "$budget" --rc "$rc" \
        --seconds "$(elapsed "$started")" --stdout "$work/$name.out" --stderr "$work/$name.err" "${dry_flag[@]}" \
        -- "$@" || printf '{"part": "%s", "status": "failed", "reason": "the recorder failed", "seconds": 0, "budget_s": %s}\n' \
        "$name" "$budget" >"$OUT/$name.json"
    if [ $rc -ne 0 ]; then
        failed=1
        tail -n 5 "$work/$name.err" | sed 's/^/   | /'
    fi
}

skip_part() {  # skip_part NAME BUDGET REASON
    "$PY" $bench/gpu_report.py skip --out "$OUT" --part "$1" --budget "$2" --reason "$3" "${dry_flag[@]}"
}

# Each part's budget and command, on the host and in the dry run (tiny sizes, few steps, fewer variants).
part_env() {
    run_part env $([ $dry = 1 ] && echo 60 || echo 25) "$PY" $bench/gpu_report.py env
}

part_compile_ahead() {
    local b=120
    local size=(--repeats 3)
    [ $dry = 1 ] && size=(--tiny --repeats 1 --no-restart)
    # On the CPU devices even on the GPU host: what is measured is the background compiles on idle cores.
    run_part compile_ahead $b env JAX_PLATFORMS=cpu "$PY" $bench/gpu_compile_ahead.py "${size[@]}" \
        --deadline-s "$(deadline $b)"
}

part_steady() {
    local b=60
    local size=(--sizes example --steps 100 --warmup 20 --repeats 3)
    [ $dry = 1 ] && size=(--sizes tiny --steps 20 --warmup 5 --repeats 1)
    run_part steady $b "$PY" $bench/gpu_steady.py --model flax "${size[@]}" --deadline-s "$(deadline $b)"
}

part_resume() {
    local b=90
    local size=(--size example --kill-at 30 --disk-every 10)
    # The dry run takes one variant of each kind (every code path; the others differ only in their folders).
    [ $dry = 1 ] && size=(--size tiny --kill-at 10 --disk-every 5 --variants shm_warm disk_cold orbax_cold)
    run_part resume $b "$PY" $bench/gpu_resume.py --model flax "${size[@]}" --deadline-s "$(deadline $b)"
}

part_maxtext() {
    local b=30
    run_part maxtext $b "$PY" $bench/gpu_maxtext.py --deadline-s "$(deadline $b)"
}

part_tiers() {
    local b=85
    local size=(--mb 1024 8192 --steps 50 --warmup 10 --disk-repeats 2)
    [ $dry = 1 ] && size=(--mb 8 16 --steps 20 --warmup 5 --disk-repeats 1)
    run_part tiers $b "$PY" $bench/gpu_tiers.py "${size[@]}" --mtbf-s 60 --deadline-s "$(deadline $b)"
}

part_fingerprint() {
    # The state's fingerprint (runtime/core/fingerprint.py) on every step, against the defaults (which take it as
    # often as costs 1% of a step), paired, as the steady part measures the defaults against the bare loop.
    local config=${GPU_CAMPAIGN_FINGERPRINT_CONFIG:-'{"fingerprint_every": 1}'}
    local b=40
    local size=(--sizes example --steps 100 --warmup 20 --repeats 2)
    [ $dry = 1 ] && size=(--sizes tiny --steps 20 --warmup 5 --repeats 1)
    run_part fingerprint $b "$PY" $bench/gpu_steady.py --model flax "${size[@]}" --config "$config" \
        --deadline-s "$(deadline $b)"
}

echo "gpu_campaign: parts [$parts], OUT=$OUT, python $PY$([ $dry = 1 ] && echo ', dry run on CPU')"
for part in $parts; do
    "part_$part"
done
"$PY" $bench/gpu_report.py table --out "$OUT" --parts $parts "${dry_flag[@]}"
echo "gpu_campaign: $(elapsed "$began") s in all; results in $OUT"
exit $failed
