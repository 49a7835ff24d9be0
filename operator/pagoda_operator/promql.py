"""PromQL text for the engines' series: quoting, and the label selector of one LLMDeployment.

Shared by the tuner's queries and the autoscalers' (KEDA triggers, prometheus-adapter rules).
Every name reaches PromQL through ``promql_string``: a PromQL string follows Go's escapes, in
which a backslash before ``-`` or ``.`` is a parse error, and a Kubernetes name is full of
``-``. A regular expression goes through ``re.escape`` first and then through it, so its
backslashes are doubled as the string needs.

Label contract: every engine series carries ``namespace`` and ``llmdeployment`` labels, the
namespace of the pod and the value of its ``pagoda.dev/llmdeployment`` label (see the
relabelling in operator/README.md).
"""

from __future__ import annotations


def promql_string(value: str) -> str:
    """``value`` as a double-quoted PromQL string literal."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def engine_selector(namespace: str, name: str) -> str:
    """The label matchers of one LLMDeployment's engine series."""
    return f"namespace={promql_string(namespace)},llmdeployment={promql_string(name)}"
