#!/usr/bin/env bash
# Advertise COUNT nvidia.com/gpu on every node of CONTEXT, so pods that request GPUs get
# scheduled on a cluster without any (the CPU engine then runs without CUDA).
# The kubelet does not reset an extended resource it does not manage, so this holds.
set -euo pipefail
CONTEXT="${1:?usage: fake-gpu.sh CONTEXT [COUNT]}"
COUNT="${2:-4}"
for node in $(kubectl --context "$CONTEXT" get nodes -o jsonpath='{.items[*].metadata.name}'); do
    kubectl --context "$CONTEXT" patch node "$node" --subresource=status --type=json \
        -p "[{\"op\": \"add\", \"path\": \"/status/capacity/nvidia.com~1gpu\", \"value\": \"$COUNT\"}]"
    echo "node $node: nvidia.com/gpu=$COUNT"
done
