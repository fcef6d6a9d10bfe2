#!/usr/bin/env bash
# The GPU tier, on a machine with one NVIDIA GPU whose Python already has torch (and torchvision,
# lightning, accelerate, transformers), in parts of at most 10 minutes each (about 25 minutes in all), so
# that each is one command on a machine lent for a short while:
#
#     bash benchmarks/gpu/run.sh setup        # install lockstep and the carried wheels (.whl/, wheels.sh)
#     bash benchmarks/gpu/run.sh tests        # lockstep doctor, the GPU tests, the CPU/Gloo tests on this torch
#     bash benchmarks/gpu/run.sh gpt          # GPT-2 small: lockstep, hand-written, Lightning, Accelerate
#     bash benchmarks/gpu/run.sh titan MODE   # lockstep against torchtitan, MODE: compile, compile+ac, compile+ac+float8
#     bash benchmarks/gpu/run.sh trace MODE   # one round of MODE with a torch.profiler trace of 3 steps of each side
#                                             # ($OUT/traces.tgz: the op tables, and the Chrome traces if small)
#     bash benchmarks/gpu/run.sh vision       # ResNet-50 images/s: Trainer, runtime API, hand-written, Lightning
#     bash benchmarks/gpu/run.sh llama        # the ~1B transformers Llama's modes against a hand-written loop
#     bash benchmarks/gpu/run.sh all          # every part in turn (about 25 minutes)
#     bash benchmarks/gpu/run.sh syncs        # host syncs in 20 Trainer steps (a torch.profiler trace)
#     bash benchmarks/gpu/run.sh brief        # one command of under 10 minutes (BUDGET seconds, default 575):
#                                             # setup, the GPU tests, vision (all four loops, one round),
#                                             # torchtitan (compile, compile+ac+float8); each part bounded by
#                                             # the time left, the most needed first (docs/gpu.md says why)
#
# Logs and tables go to $OUT (default: ./gpu-results); the torchtitan, vision and host-sync results also go into
# the JSON file $RESULTS (default: $OUT/results.json; benchmarks/gpu/results.json is the committed one), each
# part adding its own beside what is there, with the date, card, torch and commit ($LOCKSTEP_COMMIT where the
# tree has no .git).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
RESULTS=${RESULTS:-$OUT/results.json}
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
    python3 -m pytest tests/gpu -v -rA -p no:cacheprovider -n 4 2>&1 | tee "$OUT/test_gpu.txt"
    python3 -m pytest tests/dist/test_fsdp.py tests/e2e/test_fsdp_at_scale.py tests/unit/test_checkpoints.py \
      tests/e2e/test_checkpoints_killed.py tests/unit/test_runtime.py -q -p no:cacheprovider -n 8 2>&1 \
      | tee "$OUT/cpu_tests_on_this_torch.txt" | tail -25 ;;
  gpt)
    python3 benchmarks/gpu/gpt.py 2>&1 | tee "$OUT/gpt_eager.txt"
    python3 benchmarks/gpu/gpt.py --compile 2>&1 | tee "$OUT/gpt_compiled.txt" ;;
  titan)
    mode=${2:?give a mode: compile, compile+ac or compile+ac+float8}
    python3 benchmarks/gpu/torchtitan_side_by_side.py --modes "$mode" --rounds 2 --results "$RESULTS" 2>&1 | tee "$OUT/titan_$mode.txt" ;;
  trace)
    mode=${2:?give a mode: compile, compile+ac or compile+ac+float8}
    rm -rf "$OUT/traces"
    # warm-up 6: the traced steps 5-7 are none of the Trainer's logging steps (every 5th: 4, 9, 14)
    python3 benchmarks/gpu/torchtitan_side_by_side.py --modes "$mode" --rounds 1 --steps 15 --warmup 6 \
      --trace "$OUT/traces" 2>&1 | tee "$OUT/trace_$mode.txt"
    [ -d "$OUT/traces" ] || { echo "no trace was written" >&2; exit 1; }
    tar czf "$OUT/traces.tgz" -C "$OUT" traces
    if (($(stat -c %s "$OUT/traces.tgz") > 15000000)); then  # what comes back from the GPU machine: 16 MiB a file
      tar czf "$OUT/traces.tgz" -C "$OUT" --exclude='*.json' traces
    fi
    rm -rf "$OUT/traces" ;;
  vision)
    python3 benchmarks/gpu/vision.py --rounds 2 --steps 40 --warmup 10 --results "$RESULTS" 2>&1 | tee "$OUT/vision.txt" ;;
  llama)
    python3 benchmarks/gpu/llama.py --modes hand-written,compile,compile+ac 2>&1 | tee "$OUT/llama.txt" ;;
  syncs)
    python3 benchmarks/gpu/host_syncs.py --results "$RESULTS" 2>&1 | tee "$OUT/host_syncs.txt" ;;
  brief)
    start=$SECONDS
    budget=${BUDGET:-575}
    bounded() {  # bounded CAP LOG COMMAND...: at most CAP seconds, and never past the budget
      local cap=$1 log=$2 left=$((budget - (SECONDS - start)))
      shift 2
      if ((left < 25)); then echo "not run, no time left: $*" | tee -a "$OUT/$log"; return; fi
      ((cap < left)) || cap=$left
      echo "== $* (at most $cap s, at $((SECONDS - start)) s)" >>"$OUT/$log"
      timeout -k 5 "$cap" "$@" >>"$OUT/$log" 2>&1
      echo "== exit $? after $((SECONDS - start)) s" >>"$OUT/$log"
    }
    # Seen on an H200 (docs/gpu.md): each torchtitan or lockstep child takes 24-40 s, a vision child 67-80 s
    # (ResNet-50's compile), the GPU tests 40-52 s, the host-sync trace 30 s, gpt.py 70 s, setup 14 s.
    setup >"$OUT/setup.txt" 2>&1
    bounded 65 tests.txt python3 -m pytest tests/gpu -v -rA -p no:cacheprovider -n 6
    bounded 340 vision.txt python3 benchmarks/gpu/vision.py --loops hand-written,trainer,runtime,lightning \
      --rounds 1 --steps 20 --warmup 8 --results "$RESULTS"
    bounded 300 titan.txt python3 benchmarks/gpu/torchtitan_side_by_side.py --modes compile,compile+ac+float8 \
      --rounds 2 --steps 15 --warmup 6 --results "$RESULTS"
    tail -n 30 "$OUT"/*.txt ;;
  all)
    setup
    for next in tests syncs gpt "titan compile" "titan compile+ac" "titan compile+ac+float8" vision llama; do
      # shellcheck disable=SC2086  # the part and its mode are two words
      bash "$0" $next
    done ;;
  *) echo "unknown part $part: setup, tests, gpt, titan MODE, trace MODE, vision, llama, syncs, all or brief" >&2
     exit 2 ;;
esac
