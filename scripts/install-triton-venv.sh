#!/usr/bin/env bash
# Create (or update) the virtualenv in which the tests run our Python-backend models with the
# Triton image's package pins (images/triton/requirements.txt). Idempotent.
#
# The image runs Python 3.10; the venv uses python3.10 when this machine has a working one and
# python3 otherwise (TRITON_PYTHON overrides). `make lint` (vermin) keeps the models within 3.10.
set -euo pipefail
venv=${1:-.venv-triton}
cd "$(dirname "$0")/.."
requirements=images/triton/requirements.txt

python=${TRITON_PYTHON:-}
if [[ -z "$python" ]]; then
  if python3.10 -c 'pass' >/dev/null 2>&1; then python=python3.10; else python=python3; fi
fi
if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating $venv with $($python --version 2>&1)"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet -r "$requirements"
# Exactly the pins, nothing else that the models could come to depend on.
"$venv/bin/python" - "$requirements" <<'PY'
import sys
from importlib.metadata import version
pins = [l.split("#")[0].strip() for l in open(sys.argv[1]) if l.split("#")[0].strip()]
for pin in pins:
    name, wanted = pin.split("==")
    got = version(name)
    if got != wanted:
        sys.exit(f"{name} {got} installed, {wanted} pinned in {sys.argv[1]}")
PY
echo "virtualenv ready: $venv ($("$venv/bin/python" --version 2>&1))"
