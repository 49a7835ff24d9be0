#!/usr/bin/env bash
# Delete the e2e kind cluster.
set -euo pipefail
kind delete cluster --name "${E2E_CLUSTER:-pagoda-e2e}"
