#!/usr/bin/env bash
# Create (or update) the project's virtualenv with the pinned requirements. Idempotent.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."

if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating $venv with $($python --version)"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch first, the CPU build: the loader needs torch only to read PyTorch .bin checkpoints and
# make demo to train its checkpoint, on the CPU. PyPI's torch for Linux is the CUDA build (about
# 4.5 GB with its NVIDIA libraries and compiler); PyTorch's own index has the CPU build of the
# same version. Where that index cannot be reached, the pinned requirements below take PyPI's.
# TORCH_INDEX_URL= (empty) skips this step; another URL names a mirror of the CPU index.
torch_index=${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
torch_pin=$(grep -E '^torch==' requirements.txt)
if [[ -n $torch_index ]] && ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  if "$venv/bin/python" -m pip install --quiet --timeout 15 --retries 1 \
      --index-url "$torch_index" "$torch_pin" 2>/dev/null; then
    echo "torch: the CPU build, from $torch_index"
  else
    echo "torch: $torch_index cannot be reached; PyPI's CUDA build is installed instead (about 4 GB more)" >&2
  fi
fi
"$venv/bin/python" -m pip install --quiet -r requirements-dev.txt
"$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .
echo "virtualenv ready: $venv"
