#!/usr/bin/env bash
# GPU check, for the day a CUDA machine is lent: run from the repo root of a copy of the repo.
#
#   bash bench/gpu_check.sh            # everything goes to $OUT (if set) or outputs/gpu_check/
#
# 1. `make install` (creates .venv; PyPI's torch==2.13.0 wheel for Linux is the CUDA build) and a check that
#    torch sees the GPUs.
# 2. `make run` as a newcomer types it (the recipe picks CUDA/NCCL itself; default precision fp32).
# 3. The recipe at bf16-mixed with tp = the number of GPUs (the tiny Llama: 8 heads, so 1, 2, 4 or 8 GPUs).
# 3b. bench/checkpoint_async_recipe.py at a ~1B Llama, tp=1: steps with an async save in flight against
#    steps without (issue 24's <= 1.15x), a sync run beside it.
# 4. The e2e tests (tests/e2e) on this machine: the recipe runs on CUDA/NCCL; each test keeps its own
#    precision overrides.
# 5. One line per precision (fp32, bf16-mixed, bf16): tokens/s and peak memory of a ~0.44B Llama shape
#    (model.config.* overrides: hidden 1024, 24 layers, MLP 4096, 16 heads / 8 kv heads; seq_len 1024) at
#    tp = the number of GPUs, from the run's metrics.jsonl (median tokens_per_s after 3 warm-up steps, max
#    peak_memory_gib), with and without activation checkpointing.
#
# Every step runs even if an earlier one failed; the script exits non-zero if any failed and its summary
# (summary.txt) says which.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

OUT_DIR="${OUT:-outputs/gpu_check}"
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
PY=.venv/bin/python
FAILED=()
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"

step() {  # step NAME COMMAND...: run, log, remember a failure
    local name=$1
    shift
    echo "=== $name: $* ($(date -u +%H:%M:%S))"
    local started=$SECONDS
    if "$@"; then
        echo "ok   $name ($((SECONDS - started)) s)" | tee -a "$SUMMARY"
    else
        echo "FAIL $name ($((SECONDS - started)) s)" | tee -a "$SUMMARY"
        FAILED+=("$name")
    fi
}

nvidia-smi || echo "nvidia-smi not found"
make install || { echo "error: make install failed"; exit 1; }
NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
if [ "$NGPU" -lt 1 ]; then
    echo "error: torch sees no CUDA device (is the installed torch a CPU build?)"
    exit 1
fi
echo "GPUs: $NGPU"
TP=$NGPU

step "make run" make run
[ -d outputs/llama ] && cp -r outputs/llama "$OUT_DIR/make_run" 2>/dev/null

step "recipe bf16-mixed tp=$TP" $PY recipes/finetune.py train.precision=bf16-mixed tp="$TP" \
    output_dir="$OUT_DIR/bf16_mixed_tp$TP" overwrite_output_dir=true

# issue 24's last point: the step with an async save in flight against a step without, at a ~1B
# Llama (hidden 2048, 18 layers, MLP 5632: 0.93B; ~11 GB of checkpoint, keep 1), bf16-mixed.
ONE_B=(model.config.hidden_size=2048 model.config.num_hidden_layers=18 model.config.intermediate_size=5632
       model.config.num_attention_heads=16 model.config.num_key_value_heads=8 model.config.head_dim=128
       model.config.max_position_embeddings=2048 train.seq_len=1024 train.precision=bf16-mixed)
step "async save ~1B tp=1" bash -c "set -o pipefail; $PY bench/checkpoint_async_recipe.py --steps 14 --every 4 --reps 1 \
    -- ${ONE_B[*]} tp=1 | tee $OUT_DIR/checkpoint_async_1b.txt"
grep -h "^| async\|^| sync" "$OUT_DIR/checkpoint_async_1b.txt" | sed 's/^/line  async save 1B: /' >> "$SUMMARY"

# no -x: on a machine with fewer GPUs than a test's ranks that test fails; the others still run
step "e2e tests" $PY -m pytest tests/e2e -q -p no:cacheprovider

SHAPE=(model.config.hidden_size=1024 model.config.num_hidden_layers=24 model.config.intermediate_size=4096
       model.config.num_attention_heads=16 model.config.num_key_value_heads=8 model.config.head_dim=64
       model.config.max_position_embeddings=2048
       train.seq_len=1024 train.max_steps=12 train.val_every=0 checkpoint.export=false)
for precision in fp32 bf16-mixed bf16; do
    for checkpointing in none full; do
        run_dir="$OUT_DIR/half_b_${precision}_${checkpointing}_tp$TP"
        step "0.44B $precision ac=$checkpointing tp=$TP" $PY recipes/finetune.py "${SHAPE[@]}" \
            train.precision="$precision" train.activation_checkpointing="$checkpointing" tp="$TP" \
            output_dir="$run_dir" overwrite_output_dir=true
        $PY - "$run_dir/metrics.jsonl" "$precision" "$checkpointing" "$TP" <<'EOF' | tee -a "$SUMMARY"
import json, statistics, sys
path, precision, checkpointing, tp = sys.argv[1:]
try:
    lines = [json.loads(line) for line in open(path)]
except OSError:
    sys.exit(print(f"line  {precision} ac={checkpointing} tp={tp}: no metrics ({path})"))
rates = [line["tokens_per_s"] for line in lines[3:]] or [line["tokens_per_s"] for line in lines]
peak = max((line.get("peak_memory_gib") or 0.0) for line in lines)
print(f"line  0.44B Llama {precision} ac={checkpointing} tp={tp}: {statistics.median(rates):.0f} tokens/s, "
      f"peak {peak:.2f} GiB per rank ({len(lines)} steps)")
EOF
    done
done

echo
echo "=== summary"
cat "$SUMMARY"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "failed: ${FAILED[*]}"
    exit 1
fi
echo "all passed; outputs in $OUT_DIR"
