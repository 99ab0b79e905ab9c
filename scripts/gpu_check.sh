#!/usr/bin/env bash
# The one GPU run (issue 18), for a machine with an NVIDIA GPU and no network (everything it
# needs is on the machine or carried in the repository). Fits in 8 minutes: every stage has a
# cap and none may run past the overall budget (GPU_CHECK_BUDGET_S, default 465 s), leaving time
# for the report. Writes everything under one results folder:
#   env.txt          the GPU (nvidia-smi) and the library versions
#   attention.json   Triton paged attention + KV write vs torch on CUDA (bf16/fp16, head sizes
#                    64-256, GQA/MHA, split-KV), and the kernel's time on a decode batch
#   kernels.json     the LoRA kernels, Triton vs torch on CUDA
#   engine.json      triton backend (CUDA graphs and eager) vs torch, greedy, fp32 tiny Llama and
#                    Qwen3 (chunked prefill, prefix hits, preemption, LoRA); bf16 parity with HF
#   tests.log        pytest on CUDA: the engine's and LoRA's equivalence with HF / PEFT
#   decode.json      decode step at batch 64 x 1024 context, Qwen3-0.6B shape, against the
#                    HBM-bandwidth bound (triton + graphs, triton eager, torch)
#   throughput-*.json  loraplex bench throughput with 0 adapters, then 8 and 64 (each with and
#                    without its adapters), Qwen3-0.6B shape, bf16, triton backend
#   report.json, report.md   all of the above in one report naming the GPU
#   stages.txt       each stage's exit status and seconds; <stage>.log its full output
# Usage: scripts/gpu_check.sh [RESULTS_DIR]     (default: $OUT or gpu-results/)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-gpu-results}}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # the kernels must run compiled on the GPU here
PY=python3
BUDGET=${GPU_CHECK_BUDGET_S:-465}
START=$SECONDS
status=0
: > "$RESULTS/stages.txt"

# stage NAME CAP_SECONDS COMMAND...: runs COMMAND for at most CAP seconds and never past the
# budget (keeping 15 s for the report); output to NAME.log, its tail to the console.
stage() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET - 15 - (SECONDS - START)))
  local t=$((cap < left ? cap : left))
  if [ "$t" -lt 10 ]; then
    echo "$name skipped: out of time" | tee -a "$RESULTS/stages.txt"
    status=1
    return
  fi
  echo "== $name (at most ${t}s)"
  local t0=$SECONDS
  timeout -k 5 "$t" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$RESULTS/$name.log"
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$RESULTS/stages.txt"
  [ "$rc" -eq 0 ] || status=1
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$RESULTS/env.txt"
# Missing pure-Python dependencies, if carried as wheels in .whl/ (no network here)
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# The Qwen3-0.6B-shaped random model (bf16 on disk) is built on the CPU while the GPU checks run.
MODEL=/tmp/qwen3-0.6b-shape
$PY scripts/make_random_model.py "$MODEL" --preset qwen3-0.6b > "$RESULTS/make_model.log" 2>&1 &
MODEL_PID=$!

# 1. attention kernels alone on the GPU (the file ends with a timing)
stage attention 90 $PY scripts/gpu_attention_check.py "$RESULTS/attention.json"

# 2. correctness stages side by side (small models; none of them is timed)
stage kernels 120 $PY scripts/gpu_kernel_check.py "$RESULTS/kernels.json" &
P1=$!
stage engine 120 $PY scripts/gpu_engine_check.py "$RESULTS/engine.json" &
P2=$!
stage tests 120 $PY -m pytest -q -x -p no:cacheprovider \
  tests/engine/test_llm_equivalence.py tests/lora/test_lora_equivalence.py &
P3=$!
for p in $P1 $P2 $P3; do wait "$p" || status=1; done
# (a stage in the background sets status in its own subshell: read the exit codes back)
grep -qE "^(kernels|engine|tests) rc=[1-9]" "$RESULTS/stages.txt" && status=1

echo "== waiting for the model"
wait "$MODEL_PID" || { echo "make_random_model failed: $(tail -n 3 "$RESULTS/make_model.log")"; status=1; }

# 3. decode against the bandwidth bound (alone on the GPU)
stage decode 60 $PY scripts/gpu_decode_bench.py "$MODEL" "$RESULTS/decode.json" \
  --batch 64 --context 1024 --hbm-tb-s 4.8

# 4. throughput with 0, 8 and 64 adapters. The word-level tokenizer maps the bench's English
# prompts to few distinct ids, so prefix caching is off (it would share most prompts' KV).
BENCH=(bench throughput "$MODEL" --dtype bfloat16 --attention-backend triton --skip-hf
  --repeats 2 --num-requests 256 --max-num-seqs 256 --max-num-batched-tokens 2048
  --no-enable-prefix-caching --max-output 64 --output-dir "$RESULTS")
stage bench-0 50 $PY -m loraplex.cli "${BENCH[@]}" --num-adapters 0
# one process for 8 and 64: each N runs with its adapters and without, back to back
stage bench-8-64 120 $PY -m loraplex.cli "${BENCH[@]}" --num-adapters 8,64

$PY scripts/gpu_report.py "$RESULTS" > "$RESULTS/report.log" 2>&1 || status=1
cat "$RESULTS/report.md" 2>/dev/null
echo "gpu_check: results in $RESULTS, $((SECONDS - START)) s (status $status)"
exit $status
