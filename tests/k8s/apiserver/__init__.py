"""The API server's acceptance rules for a CustomResourceDefinition, without an API server.

`crd_problems(crd)` lists what kube-apiserver would refuse in a CRD (structural schema, CEL
rules type-checked against the schema, CEL cost against its limits), plus a few project
rules marked ``lint`` that the API server accepts but that make a rule or field useless.
Each module cites the Kubernetes or cel-go source it follows.
"""

from .crd_rules import Problem, crd_problems

__all__ = ["Problem", "crd_problems"]
