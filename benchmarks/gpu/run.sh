#!/usr/bin/env bash
# The GPU tier in one run, on a machine with one NVIDIA GPU whose Python already has torch:
# installs lockstep without dependencies (and torchao from .whl/ if carried there), runs `lockstep
# doctor`, the GPU tests, the GPT benchmark (eager and compiled), the ~1B Llama benchmark and the
# CPU/Gloo FSDP and checkpoint tests on that torch. Logs and tables go to $OUT (default:
# ./gpu-results).
#
#     bash benchmarks/gpu/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee "$OUT/machine.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
ls .whl/torchao-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/torchao-*.whl  # for float8
lockstep doctor 2>&1 | tee "$OUT/doctor.txt"
python3 -m pytest tests/gpu/test_gpu.py -v -p no:cacheprovider 2>&1 | tee "$OUT/test_gpu.txt"
python3 benchmarks/gpu/gpt.py 2>&1 | tee "$OUT/gpt_eager.txt"
python3 benchmarks/gpu/gpt.py --compile 2>&1 | tee "$OUT/gpt_compiled.txt"
python3 benchmarks/gpu/llama.py 2>&1 | tee "$OUT/llama.txt"
python3 -m pytest tests/dist/test_fsdp.py tests/e2e/test_fsdp_at_scale.py tests/unit/test_checkpoints.py tests/e2e/test_checkpoints_killed.py tests/unit/test_runtime.py -q -p no:cacheprovider \
  -n 8 2>&1 | tee "$OUT/cpu_tests_on_this_torch.txt" | tail -25
