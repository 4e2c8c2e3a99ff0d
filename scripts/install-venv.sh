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
# torch first: pip takes the CPU build of this exact version from the machine's local wheel store.
"$venv/bin/python" -m pip install --quiet -r requirements-dev.txt
"$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .
echo "virtualenv ready: $venv"
