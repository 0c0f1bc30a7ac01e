#!/usr/bin/env bash
# The first-GPU check, in one call on a lent GPU machine (docs/install.md): the image's python3 and
# the wheels of .whl/ (bench/gpu_wheels.sh, carried with the call), no network, ~6 minutes on one
# H200. Writes summary.txt, gpu_check.log and runs.jsonl (one record per run) to $OUT (default
# outputs/gpu_check); the run folders (checkpoints) live in a temporary folder, removed at the end.
#
#   bash bench/gpu_check.sh          # on the GPU machine: PY defaults to python3
#   bash bench/gpu_check.sh --cpu    # the same steps on this CPU at tiny shapes (PY: .venv's)
#   bash bench/gpu_check.sh --packed # step 1 and step 7 alone (with --cpu second: on this CPU)
#
# Steps, each timed and limited, each run even if an earlier one failed (the summary says which):
#  1. bench/gpu_env.py: versions against pyproject's ranges, torch's devices.
#  2. `make run PY=$PY` at 20 steps, as a newcomer types it (no .venv is made for another PY).
#  3. `pytest -m cuda`: the single-GPU tests.
#  4. Dry runs (plan.json) of every throughput run below, side by side on the CPU.
#  5. Packed rows (train.packing=true: tokens/s counts what the GPU computes, not padding) of a
#     0.44B and a 0.93B Llama shape (the names of its old ~32k vocab; the tiny tokenizer's vocab
#     gives 0.38B and 0.85B) at bf16-mixed and fp32 (TF32), activation checkpointing none and full:
#     median tokens/s, TFLOP/s and MFU after the warm-up, peak memory against the plan.
#  6. fp8 (torchao float8, tensorwise) against bf16-mixed at the 0.93B shape: the same line.
#  7. Packed 8k-token rows (2 a micro-batch) of the 0.44B shape at bf16-mixed with each attention
#     kernel, sdpa (a dense mask) and the packed-native flash_attention_2, flash_attention_3,
#     flex_attention (sequence boundaries): tokens/s and peak memory; a kernel the machine cannot
#     run is one SKIP line, the recipe's own refusal.
#  8. Host syncs per step of the 0.93B bf16-mixed run from its profiler trace (one step profiled).
#  9. bench/checkpoint_async_recipe.py at the 0.93B shape, bf16-mixed: the step after an async save
#     against the others, a sync run beside it (the async-save stall).
# Steps not started within GPU_CHECK_BUDGET_S seconds (420 on the GPU, none with --cpu) are
# skipped, and every step ends by 120 s later, so the call returns inside its 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
CPU=false PACKED_ONLY=false
[ "${1:-}" = "--packed" ] && { PACKED_ONLY=true; shift; }
[ "${1:-}" = "--cpu" ] && CPU=true
OUT_DIR=${OUT:-outputs/gpu_check}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
SUMMARY=$OUT_DIR/summary.txt
RECORDS=$OUT_DIR/runs.jsonl
RUNS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$RUNS"' EXIT
FAILED=()

if $CPU; then  # tiny shapes, few steps: every step of the device's run, in minutes on 2 cores
    PY=${PY:-.venv/bin/python}
    BUDGET=${GPU_CHECK_BUDGET_S:-0}
    HARD_END=$((BUDGET > 0 ? BUDGET + 120 : 1 << 30))
    LIMIT=1800
    STEPS=3 WARMUP=1 SEQ=128
    HALF=(hidden_size=64 num_hidden_layers=2 intermediate_size=128 num_attention_heads=4
          num_key_value_heads=2 head_dim=16 max_position_embeddings=256)
    ONE=(hidden_size=96 num_hidden_layers=2 intermediate_size=192 num_attention_heads=4
         num_key_value_heads=2 head_dim=24 max_position_embeddings=256)
    ASYNC=(--steps 5 --every 2)
    LABELS=(0.44B-slot-tiny 0.93B-slot-tiny)
    LONG=256 EXAMPLES=4000  # step 7's packed rows, and examples enough to fill them
else
    PY=${PY:-python3}
    BUDGET=${GPU_CHECK_BUDGET_S:-420}
    HARD_END=$((BUDGET + 120))  # every step ends by then: inside a 10-minute call
    LIMIT=150
    STEPS=12 WARMUP=3 SEQ=1024
    HALF=(hidden_size=1024 num_hidden_layers=24 intermediate_size=4096 num_attention_heads=16
          num_key_value_heads=8 head_dim=64 max_position_embeddings=2048)
    ONE=(hidden_size=2048 num_hidden_layers=18 intermediate_size=5632 num_attention_heads=16
         num_key_value_heads=8 head_dim=128 max_position_embeddings=2048)
    ASYNC=(--steps 10 --every 4)
    LABELS=(0.44B 0.93B)
    LONG=8192 EXAMPLES=20000  # ~40 tokens an example: 12 steps of 4 rows without a second epoch
fi
COMMON=(nproc=1 tp=1 "train.seq_len=$SEQ" train.packing=true train.val_every=0
        checkpoint.export=false "train.max_steps=$STEPS" overwrite_output_dir=true)
# No network there; a lean log.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TQDM_DISABLE=1

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log, remember a failure
    local name=$1
    STEP_LIMIT=$2  # a shell function (declare -F) applies it to its own commands
    shift 2
    if [ "$BUDGET" -gt 0 ] && [ "$SECONDS" -gt "$BUDGET" ]; then
        echo "SKIP $name (past the ${BUDGET} s budget at $SECONDS s)" | tee -a "$SUMMARY"
        FAILED+=("$name")
        return 1
    fi
    [ $((HARD_END - SECONDS)) -lt "$STEP_LIMIT" ] && STEP_LIMIT=$((HARD_END - SECONDS))
    echo "=== $name: $* ($(date -u +%H:%M:%S), $SECONDS s in, limit $STEP_LIMIT s)"
    local started=$SECONDS
    local limited=(timeout --kill-after=10 "$STEP_LIMIT")
    declare -F "$1" > /dev/null && limited=()
    if "${limited[@]}" "$@"; then
        echo "ok   $name ($((SECONDS - started)) s)" | tee -a "$SUMMARY"
    else
        echo "FAIL $name (exit $?, $((SECONDS - started)) s)" | tee -a "$SUMMARY"
        FAILED+=("$name")
        return 1
    fi
}

shape() {  # shape NAME: the model.config overrides of HALF or ONE
    local -n dims=$1
    printf 'model.config.%s\n' "${dims[@]}"
}

install_wheels() {  # the carried wheels into a folder of their own, first on PYTHONPATH
    local site=$RUNS/site
    export PYTHONPATH=$REPO
    compgen -G ".whl/*.whl" > /dev/null || { echo "no .whl/: using $PY's packages alone"; return; }
    if ! "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
        echo "$PY is not Python 3.12, the wheels' version: using its packages alone"
        return
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || return 1
    export PYTHONPATH=$site:$REPO
    echo "installed $(ls .whl/*.whl | wc -l) wheels into $site"
}

plan_all() {  # a dry run of every throughput run, side by side; plan.json in $RUNS/NAME/plan
    local pids=() name size precision checkpointing
    for size in HALF ONE; do
        for precision in bf16-mixed fp32 fp8; do
            for checkpointing in none full; do
                name=${size}_${precision}_${checkpointing}
                [ "$precision" = fp8 ] && { [ "$size" = ONE ] && [ "$checkpointing" = none ] || continue; }
                mapfile -t dims < <(shape "$size")
                timeout "$STEP_LIMIT" "$PY" recipes/finetune.py dry_run=true "${dims[@]}" \
                    "${COMMON[@]}" \
                    "train.precision=$precision" "train.activation_checkpointing=$checkpointing" \
                    "output_dir=$RUNS/$name/plan" > "$RUNS/$name.plan.log" 2>&1 &
                pids+=($!)
            done
        done
    done
    local failed=0
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    grep -h "^  total\|^error" "$RUNS"/*.plan.log
    return $failed
}

throughput() {  # throughput SIZE LABEL PRECISION CHECKPOINTING: one packed run and its line
    local size=$1 label=$2 precision=$3 checkpointing=$4
    local name=${size}_${precision}_${checkpointing}
    mapfile -t dims < <(shape "$size")
    step "$label $precision ac=$checkpointing" "$LIMIT" "$PY" recipes/finetune.py "${dims[@]}" \
        "${COMMON[@]}" "train.precision=$precision" \
        "train.activation_checkpointing=$checkpointing" "output_dir=$RUNS/$name/run"
    "$PY" bench/gpu_run_line.py "$label $precision ac=$checkpointing" \
        "$RUNS/$name/run/metrics.jsonl" "$RUNS/$name/plan/plan.json" "$WARMUP" "$RECORDS" \
        | tee -a "$SUMMARY"
    rm -rf "$RUNS/$name/run"
}

packed_attention() {  # packed_attention KERNEL: packed LONG-token rows with that attention kernel
    local kernel=$1 name=packed_$1 refused
    local label="${LABELS[0]} packed $LONG-token rows bf16-mixed $kernel"
    mapfile -t dims < <(shape HALF | grep -v max_position_embeddings)
    local args=("${dims[@]}" "model.config.max_position_embeddings=$LONG" nproc=1 tp=1
                train.packing=true "train.seq_len=$LONG" train.micro_batch_size=2
                train.global_batch_size=4 "data.num_examples=$EXAMPLES" train.val_every=0
                checkpoint.export=false "train.max_steps=$STEPS" overwrite_output_dir=true
                train.precision=bf16-mixed "model.attn_implementation=$kernel")
    refused=$(timeout "$LIMIT" "$PY" recipes/finetune.py "${args[@]}" dry_run=true \
        "output_dir=$RUNS/$name/plan" 2>&1 | grep -m1 "^error: .*attn_implementation")
    if [ -n "$refused" ]; then  # not installed, or not on this device: said, not failed
        echo "SKIP $label: ${refused#error: }" | tee -a "$SUMMARY"
        return 0
    fi
    step "$label" "$LIMIT" "$PY" recipes/finetune.py "${args[@]}" "output_dir=$RUNS/$name/run"
    "$PY" bench/gpu_run_line.py "$label" "$RUNS/$name/run/metrics.jsonl" \
        "$RUNS/$name/plan/plan.json" "$WARMUP" "$RECORDS" | tee -a "$SUMMARY"
    rm -rf "$RUNS/$name"
}

packed_kernels() {  # step 7: sdpa, then each packed-native kernel
    local kernel
    for kernel in sdpa flash_attention_2 flash_attention_3 flex_attention; do
        packed_attention "$kernel"
    done
}

host_syncs() {  # one profiled step of the 0.93B bf16-mixed run: its host syncs from the trace
    local profiled=$((WARMUP + 1)) folder=$RUNS/profiled
    mapfile -t dims < <(shape ONE)
    timeout --kill-after=10 "$STEP_LIMIT" "$PY" recipes/finetune.py "${dims[@]}" "${COMMON[@]}" \
        train.precision=bf16-mixed "train.max_steps=$profiled" "profile.steps=[$profiled,$profiled]" \
        "output_dir=$folder" || return 1
    "$PY" -c "import sys; from pathlib import Path
from components.training.profiler import OPTIMIZER_STEP, host_syncs_per_step
trace = Path(sys.argv[1]); step = int(sys.argv[2])
print(f'line  host syncs per step ${LABELS[1]} bf16-mixed: {host_syncs_per_step(trace)[step]} in all,',
      f'{host_syncs_per_step(trace, apart=OPTIMIZER_STEP)[step]} outside the optimizer step')" \
        "$folder/profile/rank0.pt.trace.json" "$profiled" | tee -a "$SUMMARY"
    local status=${PIPESTATUS[0]}
    rm -rf "$folder"
    return "$status"
}

async_save() {  # the async-save stall: bench/checkpoint_async_recipe.py's table into the summary
    mapfile -t dims < <(shape ONE)
    timeout --kill-after=10 "$STEP_LIMIT" "$PY" bench/checkpoint_async_recipe.py "${ASYNC[@]}" \
        --reps 1 -- \
        "${dims[@]}" nproc=1 tp=1 "train.seq_len=$SEQ" train.packing=true \
        train.precision=bf16-mixed | tee "$RUNS/async.txt"
    local status=${PIPESTATUS[0]}
    grep -h "^| async\|^| sync" "$RUNS/async.txt" \
        | sed "s/^/line  async save ${LABELS[1]}: /" >> "$SUMMARY"
    return "$status"
}

cuda_tests() {  # the single-GPU tests; pytest's exit 5 (none selected) said in the summary
    timeout --kill-after=10 "$STEP_LIMIT" "$PY" -m pytest -m cuda -q -p no:cacheprovider tests
    local status=$?
    [ "$status" -eq 5 ] && echo "line  pytest -m cuda: no test carries the marker" >> "$SUMMARY"
    return "$status"
}

main() {
    echo "gpu_check: PY=$PY cpu=$CPU out=$OUT_DIR runs=$RUNS load $(cut -d' ' -f1-3 /proc/loadavg)"
    command -v nvidia-smi > /dev/null && nvidia-smi
    if ! install_wheels; then
        echo "error: the wheels of .whl/ did not install" | tee -a "$SUMMARY"
        return 1
    fi
    step "env" 120 "$PY" bench/gpu_env.py .whl
    if ! $CPU && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
        echo "error: torch sees no CUDA device (run with --cpu on a CPU)" | tee -a "$SUMMARY"
        return 1
    fi
    if $PACKED_ONLY; then
        packed_kernels
        report
        return
    fi
    local run_args=(train.max_steps=20 "output_dir=$RUNS/make_run" overwrite_output_dir=true)
    local make=(make run "PY=$PY" "ARGS=${run_args[*]}")
    command -v make > /dev/null || make=("$PY" recipes/finetune.py "${run_args[@]}")  # no make
    step "make run" "$LIMIT" "${make[@]}"
    "$PY" bench/gpu_run_line.py "make run (tiny Llama, 20 steps)" "$RUNS/make_run/metrics.jsonl" \
        none "$WARMUP" "$RECORDS" | tee -a "$SUMMARY"
    step "pytest -m cuda" 240 cuda_tests
    step "dry-run plans" "$LIMIT" plan_all
    for size in HALF ONE; do
        label=$([ "$size" = HALF ] && echo "${LABELS[0]}" || echo "${LABELS[1]}")
        for precision in bf16-mixed fp32; do
            for checkpointing in none full; do
                throughput "$size" "$label" "$precision" "$checkpointing"
            done
        done
    done
    throughput ONE "${LABELS[1]}" fp8 none
    packed_kernels
    step "host syncs ${LABELS[1]}" "$LIMIT" host_syncs
    step "async save ${LABELS[1]}" $((LIMIT * 2)) async_save
    report
}

report() {  # the summary, and the steps that failed
    echo
    echo "=== summary ($SECONDS s)"
    cat "$SUMMARY"
    if [ ${#FAILED[@]} -gt 0 ]; then
        echo "failed: ${FAILED[*]}"
        return 1
    fi
    echo "all passed; outputs in $OUT_DIR"
}

: > "$SUMMARY"
: > "$RECORDS"
main 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
