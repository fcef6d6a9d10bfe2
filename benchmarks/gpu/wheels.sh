#!/usr/bin/env bash
# The wheels the GPU tier needs beside what the GPU machine has (Python 3.12, torch 2.11, transformers,
# lightning, accelerate, torchvision, timm, and pyarrow, pandas, tensorboard, xxhash), downloaded into .whl/
# (not committed) to be carried there: torchao 0.18.0 for float8 (the release for torch 2.11 and later), and
# torchtitan 0.2.2 with what its model module imports (its config: tyro; its train-spec protocol: torchdata
# and datasets). About 20 MB: one call carries them. run.sh installs them with --no-deps.
#
#     bash benchmarks/gpu/wheels.sh [PYTHON_VERSION]    # default 3.12
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-3.12}
mkdir -p .whl
python3 -m pip download -q --only-binary=:all: --python-version "$version" --no-deps -d .whl \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  torchao==0.18.0 torchtitan==0.2.2 tyro docstring_parser typeguard torchdata datasets dill multiprocess
du -sh .whl
