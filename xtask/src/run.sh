#!/usr/bin/env bash
# Runner of a bundle written by `cargo xtask bundle DIR` (also used by
# `cargo xtask test-multigpu`). Needs no Rust toolchain.
#
#   ./run.sh tests [FILTER]     every test binary, GPU tests required (logs in $MAMBA_LOG_DIR or ./logs);
#                               MAMBA_TEST_ONLY="cuda_mamba2 digest_pins" runs only the binaries so named
#                               (the same environment as the whole suite: a short device lease's subset)
#   ./run.sh bench reduce|train the benchmarks, printed as tables
#   ./run.sh bench scaling      P = 2 vs P = 1 step time of the CLI at the 130m shape (dp_scaling)
#   ./run.sh bench tree         gradient memory and step time, fixed-order vs fixed-tree, L/P = 1..64 on one GPU (tree_memory)
#   ./run.sh hf-crosscheck [DIR] our checkpoints in transformers and back (needs torch + transformers)
#
# Exit status: 0 only when every test binary passed.
set -u
here=$(cd "$(dirname "$0")" && pwd)
export MAMBA_REQUIRE_GPU="${MAMBA_REQUIRE_GPU:-1}"
# The GPU machines require NVLink SHARP off; children inherit it.
export NCCL_NVLS_ENABLE=0
# Tests that run the CLI find it here (cargo's target dir is not on this host).
export MAMBA_TRAIN_BIN="$here/bin/mamba-train"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
log="${MAMBA_LOG_DIR:-$here/logs}"
mkdir -p "$log"

gpu_count() { nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true; }

case "${1:-}" in
tests)
    filter="${2:-}"
    n=$(gpu_count)
    if [ "${n:-0}" -lt 1 ]; then
        echo "run.sh: no GPU found (nvidia-smi -L lists none); the GPU suite needs at least one" >&2
        exit 1
    fi
    # Tests that need more GPUs than this machine has skip (named below)
    # unless MAMBA_REQUIRE_GPUS demands that many.
    export MAMBA_REQUIRE_GPUS="${MAMBA_REQUIRE_GPUS:-$n}"
    echo "run.sh: $n GPU(s), tests needing up to $MAMBA_REQUIRE_GPUS required; logs in $log"
    fail=0 passed=0 failed=0 ran=0
    for t in "$here"/tests/*; do
        name=$(basename "$t")
        if [ -n "${MAMBA_TEST_ONLY:-}" ]; then
            # Binaries are named <test>-<hash>: match the part before the hash.
            case " $MAMBA_TEST_ONLY " in *" ${name%-*} "*) ;; *) continue ;; esac
        fi
        ran=$((ran + 1))
        start=$(date +%s)
        # A hung binary must not eat the whole lease: each gets a hard limit.
        if timeout -k 5 "${MAMBA_TEST_TIMEOUT:-300}" "$t" --test-threads=1 --nocapture $filter >"$log/$name.log" 2>&1; then st=ok; else st=FAILED; fail=1; fi
        res=$(grep -E '^test result' "$log/$name.log" | tail -n 1)
        p=$(echo "$res" | sed -n 's/.* \([0-9]*\) passed.*/\1/p'); f=$(echo "$res" | sed -n 's/.* \([0-9]*\) failed.*/\1/p')
        passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0}))
        echo "$st $name ($(( $(date +%s) - start )) s): ${res:-no result line}"
        if [ "$st" = FAILED ]; then
            grep -E -A12 '^---- |panicked|^failures:' "$log/$name.log" | head -n 60
        fi
    done
    if grep -l 'skipping:' "$log"/*.log >/dev/null 2>&1; then
        echo "run.sh: some tests skipped although MAMBA_REQUIRE_GPU=$MAMBA_REQUIRE_GPU:"
        grep -h 'skipping:' "$log"/*.log | sort | uniq -c
    fi
    # A subset that names no binary must not pass vacuously.
    for want in ${MAMBA_TEST_ONLY:-}; do
        if ! ls "$here"/tests/"$want"-* >/dev/null 2>&1; then
            echo "run.sh: MAMBA_TEST_ONLY names $want, which is no test binary of this bundle (see $here/tests)" >&2
            fail=1
        fi
    done
    echo "$passed passed, $failed failed${MAMBA_TEST_ONLY:+ ($ran binaries of MAMBA_TEST_ONLY)}"
    exit $fail
    ;;
bench)
    case "${2:-}" in
    reduce) exec "$here/bin/bench_reduce" "${@:3}" ;;
    peer) exec "$here/bin/bench_peer_fold" "${@:3}" ;;
    train)
        # Ours in each precision, then transformers' PyTorch path on the same
        # sizes, then the side-by-side table.
        out="${MAMBA_BENCH_DIR:-$log}"
        : > "$out/cuda_step.jsonl"
        for p in $(echo "${MAMBA_BENCH_TRAIN_PRECISIONS:-f32,tf32,bf16}" | tr ',' ' '); do
            "$here/bin/bench_cuda_step" --precision "$p" --json "$out/cuda_step-$p.jsonl" "${@:3}" || exit 1
            cat "$out/cuda_step-$p.jsonl" >> "$out/cuda_step.jsonl"
        done
        python3 "$here/scripts/bench_torch_step.py" --json "$out/torch_step.jsonl" || exit 1
        exec python3 "$here/scripts/bench_torch_step.py" --report "$out/cuda_step.jsonl" "$out/torch_step.jsonl"
        ;;
    scaling) exec "$here/bin/dp_scaling" "${@:3}" ;;
    tree) exec "$here/bin/tree_memory" --device cuda "${@:3}" ;;
    *) echo "usage: run.sh bench reduce|peer|train|scaling|tree [ARGS]" >&2; exit 2 ;;
    esac
    ;;
hf-crosscheck)
    # Our checkpoints in transformers and transformers' in ours (scripts/hf_crosscheck.py).
    exec python3 "$here/scripts/hf_crosscheck.py" "$here/bin/hf_logits" "$here/bin/mamba-train" "${2:-/tmp/hf-crosscheck}" "${@:3}"
    ;;
*)
    echo "usage: run.sh tests [FILTER] | run.sh bench reduce|train|scaling [ARGS] | run.sh hf-crosscheck [WORKDIR]" >&2
    exit 2
    ;;
esac
