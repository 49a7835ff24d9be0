#!/usr/bin/env bash
# Create the kind cluster the e2e suite runs against, with the CPU engine and operator images
# loaded and a fake nvidia.com/gpu capacity on the node.
#
#   bash e2e/kind-up.sh            # then: .venv/bin/python -m pytest -q e2e
#
# Needs docker, kind, kubectl and helm (bash scripts/fetch-k8s-tools.sh .tools gives the last two).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.tools/bin:$PATH"

CLUSTER="${E2E_CLUSTER:-pagoda-e2e}"
ENGINE_IMAGE="${E2E_ENGINE_IMAGE:-pagoda-engine-cpu:dev}"
OPERATOR_IMAGE="${E2E_OPERATOR_IMAGE:-pagoda-operator:dev}"
FAKE_GPUS="${E2E_FAKE_GPUS:-4}"

for tool in docker kind kubectl helm; do
    command -v "$tool" >/dev/null 2>&1 || { echo "kind-up: '$tool' is required" >&2; exit 1; }
done

if ! kind get clusters | grep -qx "$CLUSTER"; then
    kind create cluster --name "$CLUSTER" --wait 120s
fi

docker build --target engine-cpu -t "$ENGINE_IMAGE" .
docker build --target operator -t "$OPERATOR_IMAGE" .
kind load docker-image --name "$CLUSTER" "$ENGINE_IMAGE" "$OPERATOR_IMAGE"

bash e2e/fake-gpu.sh "kind-$CLUSTER" "$FAKE_GPUS"
echo "cluster kind-$CLUSTER is ready; run: .venv/bin/python -m pytest -q e2e"
