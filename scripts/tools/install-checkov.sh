#!/usr/bin/env bash
# Install pinned checkov (policy scanner for the rendered Helm chart) into its own virtualenv
# under $TOOLS_DIR/checkov-venv (~290 MB; kept apart so its pins never clash with .venv), and
# link it as $TOOLS_DIR/bin/checkov. Idempotent.
set -euo pipefail

: "${TOOLS_DIR:?set TOOLS_DIR (the Makefile passes .tools)}"
version=3.3.30
venv="$TOOLS_DIR/checkov-venv"
bin="$TOOLS_DIR/bin"
python=${PYTHON:-python3}
# Written once checkov reported the pinned version (starting checkov takes seconds: every
# `make test` runs this script).
stamp="$venv/.installed-$version"
mkdir -p "$bin"

if [[ -x "$venv/bin/checkov" ]] && { [[ -f "$stamp" ]] ||
   [[ "$("$venv/bin/checkov" --version 2>/dev/null)" == "$version" ]]; }; then
  touch "$stamp"
  echo "checkov $version already installed"
else
  echo "installing checkov $version into $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "checkov==$version"
  got=$("$venv/bin/checkov" --version)
  [[ "$got" == "$version" ]] || { echo "checkov reports $got, not $version" >&2; exit 1; }
  touch "$stamp"
fi
# relative: the link keeps working wherever the tools directory is moved or linked from
ln -sfn ../checkov-venv/bin/checkov "$bin/checkov"
