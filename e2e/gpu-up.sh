#!/usr/bin/env bash
# Prepare a GPU cluster for the e2e suite: build and push the images, check what the tests
# need from the cluster, and print the command that runs them.
#
#   E2E_KUBE_CONTEXT=my-gpu-cluster REGISTRY=registry.example.com/ml bash e2e/gpu-up.sh
#
# Needs docker (logged in to REGISTRY), kubectl and helm. The cluster needs the NVIDIA device
# plugin (nodes advertise nvidia.com/gpu), a default StorageClass (the model cache claim) and
# pulls from REGISTRY.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.tools/bin:$PATH"

CONTEXT="${E2E_KUBE_CONTEXT:?set E2E_KUBE_CONTEXT to the kubectl context of the GPU cluster}"
REGISTRY="${REGISTRY:?set REGISTRY to a registry the cluster pulls from}"
TAG="${TAG:-e2e-$(git rev-parse --short HEAD)}"

for tool in docker kubectl helm; do
    command -v "$tool" >/dev/null 2>&1 || { echo "gpu-up: '$tool' is required" >&2; exit 1; }
done

GPU_PATH='{range .items[*]}{.status.allocatable.nvidia\.com/gpu}{"\n"}{end}'
gpus=$(kubectl --context "$CONTEXT" get nodes -o "jsonpath=$GPU_PATH" | awk '{t += $1} END {print t + 0}')
if [[ "$gpus" -lt 1 ]]; then
    echo "gpu-up: no node of $CONTEXT advertises nvidia.com/gpu (install the NVIDIA device plugin)" >&2
    exit 1
fi
DEFAULT_CLASS_PATH='{.items[?(@.metadata.annotations.storageclass\.kubernetes\.io/is-default-class=="true")].metadata.name}'
if ! kubectl --context "$CONTEXT" get storageclass -o "jsonpath=$DEFAULT_CLASS_PATH" | grep -q .; then
    echo "gpu-up: $CONTEXT has no default StorageClass (the model cache claim needs one)" >&2
    exit 1
fi

make push REGISTRY="$REGISTRY" TAG="$TAG"

cat <<DONE
$CONTEXT: $gpus GPUs. Run the suite with:
  E2E_GPU=1 E2E_KUBE_CONTEXT=$CONTEXT \\
  E2E_ENGINE_IMAGE=$REGISTRY/pagoda-engine:$TAG E2E_OPERATOR_IMAGE=$REGISTRY/pagoda-operator:$TAG \\
  .venv/bin/python -m pytest -q e2e
(test_rollout_with_every_gpu_taken fills all $gpus GPUs, with one replica each, when there are at most 8.)
DONE
