#!/usr/bin/env bash
# `make gpu-run OUT=DIR` / `make test-gpu` (scripts/test_gpu.sh [DIR]): the prepared GPU run, one command,
# within 8 minutes on one H100. For a machine with CUDA torch >= 2.11, transformers and pytest (no network;
# no vLLM, Ray, flash-attn or omegaconf): the wheels of .whl/ (scripts/gpu_wheels.sh) go into a scratch
# target on top of its own python3, then
#   1. pytest tests/gpu: CUDA exactness forward and backward (4 architectures, packed / padded /
#      shared prompts, bf16 vs the fp32 oracle, a boundary-leak control, the profiler), the fp32
#      fallback, the LM head (19000 tokens vs fp64 included), FSDP2 on nccl + offload, 20 steps of the
#      default GRPO job;
#   2. rlpad bench head --sweep --device cuda at 4800 and 19000 tokens (the tile table's candidates);
#   3. rlpad bench head|logprob|prefix --device cuda, every peer column; logprob --vl (Qwen2.5-VL-7B's language
#      shape, 4 layers, + its 32-block vision tower: padded / rmpad / shared prompts with images, the tower's share);
#   4. one report: DIR/report.md + report.json (scripts/gpu_report.py): GPU, versions, every figure
#      beside its target (issue #34) and the 2026-11-24 baseline (rlpad/bench/gpu_targets.py).
# DIR defaults to $RLPAD_GPU_OUT or results/gpu. Exits non-zero if a test or a benchmark failed; without a
# CUDA device, at once with one line.
# RLPAD_GPU_DRY_RUN=1: the same steps on the CPU at tiny shapes (benches with --dry-run, the sweep under
# Triton's interpreter from <venv>/triton-interpreter, tests/gpu skipped), PY's own packages, no install
# step: tests/test_gpu_lane.py runs it in `make test`, so the glue is exercised on every commit.
set -uo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE"
PY=${PY:-python3}
OUT=${1:-${RLPAD_GPU_OUT:-results/gpu}}
SITE=${RLPAD_GPU_SITE:-/tmp/rlpad-gpu-site}
DRY=${RLPAD_GPU_DRY_RUN:-0}
# Time limits (s) of the steps (each overridable: RLPAD_GPU_TEST_S ...), against what the H200 of 2026-11-27 took:
# install 30 (19), tests 110 (51-68), sweep 80 with a 50 s budget (65: 16 of its 27 configurations), head 30 (17),
# logprob's four peer columns 150 (not measured: two runs with packed_flex among them wrote nothing in 120 and 180 s),
# prefix 45 (28), compiled 110 (99, 63 of it inductor), flex 120 (not measured), logprob --vl 90 (not measured): 765 s
# at most, ~300 s measured
# plus the two unmeasured steps. The sweep starts no configuration after SWEEP_BUDGET_S, so its JSON is written
# inside its limit; logprob writes its JSON after each shape.
TEST_S=${RLPAD_GPU_TEST_S:-110}
SWEEP_S=${RLPAD_GPU_SWEEP_S:-80}
SWEEP_BUDGET_S=${RLPAD_GPU_SWEEP_BUDGET_S:-50}
HEAD_S=${RLPAD_GPU_HEAD_S:-30}
LOGPROB_S=${RLPAD_GPU_LOGPROB_S:-150}
BENCH_S=${RLPAD_GPU_BENCH_S:-45}
COMPILED_S=${RLPAD_GPU_COMPILED_S:-110}
FLEX_S=${RLPAD_GPU_FLEX_S:-120}
VL_S=${RLPAD_GPU_VL_S:-90}  # not measured: a 2.7B-parameter random model, 32 rows with images, 3 paths

if [ "$DRY" = 1 ]; then  # a shared CPU, not the GPU's budget: each step gets 10 minutes
    TEST_S=600 SWEEP_S=600 HEAD_S=600 LOGPROB_S=600 BENCH_S=600 COMPILED_S=600 FLEX_S=600 VL_S=600
    SIDE=${RLPAD_TRITON_INTERPRETER:-$($PY -c 'import sys; print(sys.prefix)')/triton-interpreter}
    BENCH=(--dry-run --reps 1)
    HEAD_SIZES=(--tokens 16 40 --hidden 32 --vocab 101)
    SWEEP_ARGS=("${HEAD_SIZES[@]}" --budget-s 600)
    SWEEP_ENV=(env TRITON_INTERPRET=1 "PYTHONPATH=$HERE:$SIDE")
else
    # shellcheck disable=SC2086
    why=$($PY -c 'import torch; print("" if torch.cuda.is_available() else f"torch {torch.__version__} sees none")' 2>/dev/null) \
        || why="$PY has no torch"
    if [ -n "$why" ]; then
        echo "make test-gpu: no CUDA device ($why); the GPU lane runs on a CUDA machine" >&2
        exit 1
    fi
    BENCH=()
    HEAD_SIZES=()
    SWEEP_ARGS=(--budget-s "$SWEEP_BUDGET_S")
    SWEEP_ENV=()
fi

start=$(date +%s)
rm -rf "$OUT"
mkdir -p "$OUT"
step() {  # step NAME LIMIT_S CMD...: run, log to $OUT/NAME.log, append "NAME rc seconds" to steps.tsv
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$OUT/steps.tsv"
    echo "test-gpu: $name rc=$rc ($(( $(date +%s) - t0 )) s, $OUT/$name.log)"
    return $rc
}

if [ "$DRY" = 1 ]; then
    export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
elif ! step install 30 bash scripts/gpu_site.sh "$SITE"; then
    cat "$OUT/install.log" >&2
    exit 1
else
    export PYTHONPATH="$HERE:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export RLPAD_GPU_OUT="$OUT" PYTHONUNBUFFERED=1
# shellcheck disable=SC2086
step tests "$TEST_S" $PY -m pytest tests/gpu -q -p no:cacheprovider --junitxml="$OUT/junit.xml"
tests_rc=$?
tail -n 15 "$OUT/tests.log"
# shellcheck disable=SC2086
step bench_head_sweep "$SWEEP_S" "${SWEEP_ENV[@]}" $PY -m rlpad.cli bench head --sweep --device cuda "${BENCH[@]}" \
    "${SWEEP_ARGS[@]}" --out "$OUT/bench_head_sweep.json"
sweep_rc=$?
# shellcheck disable=SC2086
step bench_head "$HEAD_S" $PY -m rlpad.cli bench head --device cuda "${BENCH[@]}" "${HEAD_SIZES[@]}" \
    --out "$OUT/bench_head.json"
head_rc=$?
# shellcheck disable=SC2086
step bench_logprob "$LOGPROB_S" $PY -m rlpad.cli bench logprob --device cuda "${BENCH[@]}" --columns peers \
    --out "$OUT/bench_logprob.json"
lp_rc=$?
# shellcheck disable=SC2086
step bench_prefix "$BENCH_S" $PY -m rlpad.cli bench prefix --device cuda "${BENCH[@]}" --out "$OUT/bench_prefix.json"
prefix_rc=$?
# a vision-language batch (issue #53): before the compiled / flex steps, whose compilation time is unmeasured
# shellcheck disable=SC2086
step bench_logprob_vl "$VL_S" $PY -m rlpad.cli bench logprob --vl --device cuda "${BENCH[@]}" --no-memory \
    --out "$OUT/bench_logprob_vl.json"
vl_rc=$?
# decoder layers under torch.compile (issue #47): rmpad vs packed_compiled, compile time apart; last, in its own
# limit, so a slow or failing compilation costs no other figure
# shellcheck disable=SC2086
step bench_compiled "$COMPILED_S" $PY -m rlpad.cli bench logprob --device cuda "${BENCH[@]}" --columns compiled \
    --no-memory --out "$OUT/bench_compiled.json"
compiled_rc=$?
# packed flex_attention (transformers compiles it): last, in its own limit, for the same reason
# shellcheck disable=SC2086
step bench_flex "$FLEX_S" $PY -m rlpad.cli bench logprob --device cuda "${BENCH[@]}" --columns flex \
    --no-memory --out "$OUT/bench_flex.json"
flex_rc=$?
dry=()
[ "$DRY" = 1 ] && dry=(--dry-run)
# shellcheck disable=SC2086
$PY scripts/gpu_report.py "$OUT" --wall-s "$(( $(date +%s) - start ))" "${dry[@]}"
report_rc=$?
for rc in $tests_rc $sweep_rc $head_rc $lp_rc $prefix_rc $vl_rc $compiled_rc $flex_rc $report_rc; do
    [ "$rc" -eq 0 ] || exit 1
done
