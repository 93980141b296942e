#!/usr/bin/env bash
# The GPU figures the documentation waits for, in one call, after tests/gpu/run.sh
# has made .venv-gpu/ (it reuses that venv):
#
#     tests/gpu/figures.sh [OUT]        # OUT: default results/gpu, JSONL and logs
#
#  1. --sync local against a bare PyTorch loop on one GPU (strategies.bench's `bare`),
#     the 25M-parameter GPT (8 layers, d_model 512, seq 256, batch 32), fp32 and bf16;
#  2. the same GPT at 2 ranks sharing the GPU over the ring: exposed communication
#     with the comm thread's overlap and without, fp32 and bf16, beside `local`
#     (each rank alone: the step without communication); then fp32 again with
#     TOPOLAB_CUDA_IPC=0 (staged through host memory), its records last in exposed.jsonl;
#  3. fp16 against bf16 on a small GPT (2 layers, d_model 64) at 2 ranks, the two
#     launches alternated three times;
#  4. allreduce.bench --device cuda at 2 ranks (the NCCL row skipped with its note);
#  5. the layout planner on the GPU: the host's links calibrated, then for each axis
#     alone (tp, pp, dp at 2 ranks sharing the GPU) the best and the worst layout
#     predicted and measured (experiments.plan --device cuda --verify 1).
# Each command is printed before it runs; `nvidia-smi -L` names the card, at the top
# of commands.log.  Seven files in OUT: commands.log, output.log and five JSONL.
# STEPS="1 2" runs those steps only (default: all five).
# DEVICE=cpu TINY=1 runs the same commands on a CPU with tiny models, to check them.
set -uo pipefail

cd "$(dirname "$0")/../.."
OUT=${1:-results/gpu}
VENV=${VENV:-.venv-gpu}
DEVICE=${DEVICE:-cuda}
PY="$VENV/bin/python"
export PATH="$PWD/$VENV/bin:$PATH"
mkdir -p "$OUT"
[ -x "$PY" ] || { echo "tests/gpu/figures.sh: error: no $PY: run tests/gpu/run.sh first" >&2; exit 2; }

if [ -n "${TINY:-}" ]; then
    BIG=(--model gpt --layers 2 --d-model 32 --heads 2 --seq-len 16 --vocab 64 --global-batch 8)
    SMALL=("${BIG[@]}")
    PLAN=(--layers 2 --d-model 32 --heads 2 --seq-len 16 --vocab 64 --global-batch 8)
    ROUNDS=(--rounds 2 --steps-per-round 2 --warmup 1)
else
    BIG=(--model gpt --layers 8 --d-model 512 --heads 8 --seq-len 256 --global-batch 32)
    SMALL=(--model gpt --layers 2 --d-model 64 --heads 4 --seq-len 64 --global-batch 32)
    PLAN=(--layers 8 --d-model 512 --heads 8 --seq-len 256 --vocab 32 --global-batch 32)
    ROUNDS=(--rounds 5 --steps-per-round 5 --warmup 2)
fi

STEPS=" ${STEPS:-1 2 3 4 5} "
want() { [[ "$STEPS" == *" $1 "* ]]; }

status=0
run() {
    echo "+ $*" | tee -a "$OUT/commands.log"
    "$@" 2>&1 | tee -a "$OUT/output.log" || status=1
}

command -v nvidia-smi >/dev/null && nvidia-smi -L | tee -a "$OUT/commands.log"
started=$SECONDS
if want 1; then
    for precision in fp32 bf16; do
        run "$PY" -m strategies.bench --syncs local,bare "${BIG[@]}" --precision $precision \
            --device "$DEVICE" "${ROUNDS[@]}" --jsonl "$OUT/local_vs_bare.jsonl"
    done
fi
if want 2; then
    for precision in fp32 bf16; do
        run mpiexec -n 2 "$PY" -m mpi4py -m strategies.bench \
            --syncs local,ring,ring:no-overlap "${BIG[@]}" --precision $precision \
            --device "$DEVICE" "${ROUNDS[@]}" --jsonl "$OUT/exposed.jsonl"
    done
    # fp32 again, the ranks' tensors staged through host memory as before CUDA IPC
    echo "# with TOPOLAB_CUDA_IPC=0:" | tee -a "$OUT/commands.log"
    TOPOLAB_CUDA_IPC=0 run mpiexec -n 2 "$PY" -m mpi4py -m strategies.bench \
        --syncs local,ring,ring:no-overlap "${BIG[@]}" --precision fp32 --device "$DEVICE" \
        "${ROUNDS[@]}" --jsonl "$OUT/exposed.jsonl"
fi
if want 3; then
    for round in 1 2 3; do
        for precision in fp16 bf16; do
            run mpiexec -n 2 "$PY" -m mpi4py -m strategies.bench --syncs ring "${SMALL[@]}" \
                --precision $precision --device "$DEVICE" "${ROUNDS[@]}" \
                --jsonl "$OUT/fp16_vs_bf16.jsonl"
        done
    done
fi
if want 4; then
    run mpiexec -n 2 "$PY" -m mpi4py -m allreduce.bench --device "$DEVICE" --algos ring,mpi \
        --sizes 4K,16M --iters 10 --jsonl "$OUT/allreduce.jsonl"
fi
if want 5; then
    cal=$(mktemp -d)
    run "$PY" -m experiments.calibrate --no-ps --out "$cal"
    for axis in "--tp-sizes 2" "--pp-sizes 2" "--tp-sizes 1 --pp-sizes 1"; do
        # shellcheck disable=SC2086  # the axis's two flags, split on purpose
        run "$PY" -m experiments.plan "${PLAN[@]}" --calibration "$cal" \
            --device "$DEVICE" --gpus-per-node 2 $axis --zero 0,1 --recompute none \
            --micro-batch-sizes 4,8 --verify 1 --steps 6 --measure-s 5 \
            --jsonl "$OUT/plan.jsonl"
    done
    rm -rf "$cal"
fi
echo "tests/gpu/figures.sh: done in $((SECONDS - started)) s, exit $status; $OUT" >&2
exit $status
