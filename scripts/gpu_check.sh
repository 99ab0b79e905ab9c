#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU and no network (everything it needs is either on
# the machine or carried in the repository). Writes everything under one results folder:
#   1. the LoRA kernel tests: Triton vs torch on CUDA (bf16, fp16, ranks 8-64, up to 4096 tokens
#      and 64 adapters) -> kernels.json
#   2. the engine / LoRA correctness tests on CUDA (HF and PEFT equivalence) -> tests.log
#   3. the throughput benchmark with 0, 8 and 64 adapters on a random SmolLM2-shaped model
#      (weights do not change throughput with ignore_eos) -> bench-*.json
# Usage: scripts/gpu_check.sh [RESULTS_DIR]     (default: $OUT or gpu-results/)
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${1:-${OUT:-gpu-results}}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=python3
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$RESULTS/env.txt"
# Missing pure-Python dependencies of the tests, if carried as wheels in .whl/
if [ -d .whl ]; then $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"; fi

echo "== 1. kernels (Triton vs torch on CUDA)"
timeout 240 $PY scripts/gpu_kernel_check.py "$RESULTS/kernels.json" 2>&1 | tee "$RESULTS/kernels.log" || status=1

echo "== 2. engine and LoRA correctness on CUDA (fp32 on the GPU, against HF/PEFT on the CPU)"
timeout 300 $PY -m pytest -q -x -p no:cacheprovider \
  tests/engine/test_llm_equivalence.py tests/lora/test_lora_equivalence.py tests/kernels 2>&1 | tail -n 30 | tee "$RESULTS/tests.log" || status=1

echo "== 3. throughput with 0, 8 and 64 adapters (random SmolLM2-shaped model, bf16)"
MODEL=/tmp/smollm2-shape
$PY scripts/make_random_model.py "$MODEL" >/dev/null
for n in 0 8 64; do
  timeout 150 $PY -m loraplex.cli bench throughput "$MODEL" --dtype bfloat16 --num-adapters "$n" \
    --skip-hf --repeats 3 --max-num-seqs 256 --num-requests 256 --output-dir "$RESULTS" 2>&1 \
    | tail -n 15 | tee "$RESULTS/bench-$n.log" || status=1
done
echo "gpu_check: results in $RESULTS (status $status)"
exit $status
