#!/usr/bin/env bash
# Install AIPerf (NVIDIA's LLM benchmark, GenAI-Perf's successor) into its own virtualenv.
# Idempotent. Not part of `make tools`: it is large (pyarrow, scipy, plotting, about 1 GB with
# its dependencies) and only `make bench-llm` uses it.
#
# Usage: scripts/tools/install-aiperf.sh [VENV]   (default bench/work/aiperf-venv)
set -euo pipefail

AIPERF_VERSION=0.13.0
cd "$(dirname "$0")/../.."
venv=${1:-bench/work/aiperf-venv}
PYTHON=${PYTHON:-python3}
stamp="$venv/.installed-aiperf-$AIPERF_VERSION"

if [[ -f "$stamp" && -x "$venv/bin/aiperf" ]]; then
  exit 0
fi
echo "aiperf: installing aiperf==$AIPERF_VERSION into $venv (a few minutes)"
rm -rf "$venv"
"$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "aiperf==$AIPERF_VERSION"
got=$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("aiperf"))')
[[ "$got" == "$AIPERF_VERSION" ]] || { echo "aiperf $got installed, $AIPERF_VERSION wanted" >&2; exit 1; }
touch "$stamp"
echo "aiperf ready: $venv/bin/aiperf"
