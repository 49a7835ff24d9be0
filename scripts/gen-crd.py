"""Generate every copy of the LLMDeployment CRD from its one source, manifests/crd.yaml.

manifests/crd.yaml is the file people edit (and `kubectl apply -f manifests/` applies). The
Helm chart ships the same CRD in crds/, which Helm installs as plain YAML before the chart's
templates. tests/k8s/test_helm.py fails when a copy is stale.

    python scripts/gen-crd.py           # rewrite the copies
    python scripts/gen-crd.py --check   # exit 1, naming the stale copies, without writing
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "manifests" / "crd.yaml"
COPIES = (ROOT / "helm" / "pagoda-operator" / "crds" / "llmdeployments.pagoda.dev.yaml",)
HEADER = "# Generated from manifests/crd.yaml by scripts/gen-crd.py: edit that file, then run it.\n"


def generated() -> str:
    """A copy's text: the source unchanged (comments included) under a header."""
    return HEADER + SOURCE.read_text()


def stale_copies() -> list[Path]:
    text = generated()
    return [path for path in COPIES if not path.is_file() or path.read_text() != text]


def main(argv: list[str]) -> int:
    stale = stale_copies()
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python scripts/gen-crd.py")
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(generated())
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
