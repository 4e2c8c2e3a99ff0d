#!/usr/bin/env bash
# Install the real perf_analyzer (Triton's load generator) into $TOOLS_DIR. Idempotent.
#
# The tritonclient 2.41.0 manylinux1 x86_64 wheel ships bin/perf_analyzer. It needs libb64
# (Debian package libb64-0d) and libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12); no GPU is
# needed to drive a CPU Triton. It lives in its own virtualenv because that tritonclient clashes
# with the protobuf of the project's venv. $TOOLS_DIR/bin/perf_analyzer is a wrapper that sets
# LD_LIBRARY_PATH and runs it.
set -euo pipefail

TRITONCLIENT_VERSION=2.41.0
CUDART_VERSION=12.3.101
: "${TOOLS_DIR:?set TOOLS_DIR (make install sets it)}"
PYTHON=${PYTHON:-python3}

venv="$TOOLS_DIR/perf-analyzer"
wrapper="$TOOLS_DIR/bin/perf_analyzer"
stamp="$venv/.installed-tritonclient-$TRITONCLIENT_VERSION-cudart-$CUDART_VERSION"

have_libb64() { /sbin/ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; }

if ! have_libb64; then
  echo "perf_analyzer: installing libb64-0d (apt)"
  as_root=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "perf_analyzer needs libb64-0d: run 'apt-get install libb64-0d' as root" >&2; exit 1; }
    as_root=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! "${as_root[@]}" apt-get install -y --no-install-recommends libb64-0d; then
    "${as_root[@]}" apt-get update
    "${as_root[@]}" apt-get install -y --no-install-recommends libb64-0d
  fi
fi

if [[ -f "$stamp" && -x "$wrapper" ]]; then
  exit 0
fi

echo "perf_analyzer: installing tritonclient==$TRITONCLIENT_VERSION into $venv"
rm -rf "$venv"
"$PYTHON" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  "tritonclient==$TRITONCLIENT_VERSION" "nvidia-cuda-runtime-cu12==$CUDART_VERSION"

cudart_dir=$("$venv/bin/python" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia.cuda_runtime")
print(pathlib.Path(list(spec.submodule_search_locations)[0]) / "lib")
PY
)
[[ -e "$cudart_dir/libcudart.so.12" ]] || { echo "libcudart.so.12 not found in $cudart_dir" >&2; exit 1; }
[[ -x "$venv/bin/perf_analyzer" ]] || { echo "perf_analyzer binary missing from the wheel" >&2; exit 1; }

mkdir -p "$TOOLS_DIR/bin"
tmp=$(mktemp "$TOOLS_DIR/bin/.perf_analyzer.XXXXXX")
cat > "$tmp" <<WRAPPER
#!/usr/bin/env bash
# perf_analyzer from tritonclient $TRITONCLIENT_VERSION (installed by scripts/tools/install-perf-analyzer.sh)
export LD_LIBRARY_PATH="$cudart_dir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$venv/bin/perf_analyzer" "\$@"
WRAPPER
chmod 0755 "$tmp"
mv -f "$tmp" "$wrapper"

# Smoke test: a missing shared library makes it fail before printing its usage.
usage=$("$wrapper" 2>&1 || true)
if [[ $usage != *"SYNOPSIS"* ]]; then
  echo "perf_analyzer does not start; check 'ldd $venv/bin/perf_analyzer'" >&2
  exit 1
fi
touch "$stamp"
echo "perf_analyzer ready: $wrapper"
