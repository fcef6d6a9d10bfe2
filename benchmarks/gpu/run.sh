#!/usr/bin/env bash
# The GPU tier, on a machine with one NVIDIA GPU whose Python already has torch (and torchvision,
# lightning, accelerate, transformers), in parts of at most 10 minutes each (about 25 minutes in all), so
# that each is one command on a machine lent for a short while:
#
#     bash benchmarks/gpu/run.sh setup        # install lockstep and the carried wheels (.whl/, wheels.sh)
#     bash benchmarks/gpu/run.sh tests        # lockstep doctor, the GPU tests, the CPU/Gloo tests on this torch
#     bash benchmarks/gpu/run.sh gpt          # GPT-2 small: lockstep, hand-written, Lightning, Accelerate
#     bash benchmarks/gpu/run.sh titan MODE   # lockstep against torchtitan, MODE: compile, compile+ac, compile+ac+float8
#     bash benchmarks/gpu/run.sh vision       # ResNet-50 images/s: Trainer, runtime API, hand-written, Lightning
#     bash benchmarks/gpu/run.sh llama        # the ~1B transformers Llama's modes against a hand-written loop
#     bash benchmarks/gpu/run.sh all          # every part in turn (about 25 minutes)
#
# Logs and tables go to $OUT (default: ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:-all}

setup() {
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  } 2>&1 | tee "$OUT/machine.txt"
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
  if ls .whl/*.whl >/dev/null 2>&1; then  # torchao (float8), torchtitan and what its model module imports
    python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
  fi
}

case "$part" in
  setup) setup ;;
  tests)
    lockstep doctor 2>&1 | tee "$OUT/doctor.txt"
    python3 -m pytest tests/gpu/test_gpu.py -v -p no:cacheprovider 2>&1 | tee "$OUT/test_gpu.txt"
    python3 -m pytest tests/dist/test_fsdp.py tests/e2e/test_fsdp_at_scale.py tests/unit/test_checkpoints.py \
      tests/e2e/test_checkpoints_killed.py tests/unit/test_runtime.py -q -p no:cacheprovider -n 8 2>&1 \
      | tee "$OUT/cpu_tests_on_this_torch.txt" | tail -25 ;;
  gpt)
    python3 benchmarks/gpu/gpt.py 2>&1 | tee "$OUT/gpt_eager.txt"
    python3 benchmarks/gpu/gpt.py --compile 2>&1 | tee "$OUT/gpt_compiled.txt" ;;
  titan)
    mode=${2:?give a mode: compile, compile+ac or compile+ac+float8}
    python3 benchmarks/gpu/torchtitan_side_by_side.py --modes "$mode" --rounds 2 2>&1 | tee "$OUT/titan_$mode.txt" ;;
  vision)
    python3 benchmarks/gpu/vision.py --rounds 2 --steps 40 --warmup 10 2>&1 | tee "$OUT/vision.txt" ;;
  llama)
    python3 benchmarks/gpu/llama.py --modes hand-written,compile,compile+ac 2>&1 | tee "$OUT/llama.txt" ;;
  all)
    setup
    for next in tests gpt "titan compile" "titan compile+ac" "titan compile+ac+float8" vision llama; do
      # shellcheck disable=SC2086  # the part and its mode are two words
      bash "$0" $next
    done ;;
  *) echo "unknown part $part: setup, tests, gpt, titan MODE, vision, llama or all" >&2; exit 2 ;;
esac
