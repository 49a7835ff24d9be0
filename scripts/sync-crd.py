"""Copy the LLMDeployment CRD's spec from manifests/crd.yaml into the Helm chart.

manifests/crd.yaml is the one place the CRD is edited; the chart templates its metadata
around this copy. tests/k8s/test_helm.py fails when the two drift apart.

    python scripts/sync-crd.py
"""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "manifests" / "crd.yaml"
TARGET = ROOT / "helm" / "pagoda-operator" / "files" / "llmdeployment-crd-spec.yaml"
HEADER = "# Copied from manifests/crd.yaml by scripts/sync-crd.py; edit that file instead.\n"


def main() -> None:
    crd = yaml.safe_load(SOURCE.read_text())
    body = yaml.safe_dump(crd["spec"], sort_keys=False, width=100, allow_unicode=True)
    TARGET.write_text(HEADER + body)
    print(f"wrote {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
