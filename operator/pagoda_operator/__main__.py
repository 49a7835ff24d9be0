"""``python -m pagoda_operator``: the operator over every namespace, with a liveness endpoint."""

import os

import kopf

from pagoda_operator import handlers  # noqa: F401  (registers the handlers)


def main() -> None:
    kopf.configure(verbose=os.environ.get("PAGODA_OPERATOR_VERBOSE") == "1")
    kopf.run(
        standalone=True,
        clusterwide=True,
        liveness_endpoint=os.environ.get("PAGODA_LIVENESS_ENDPOINT", "http://0.0.0.0:8080/healthz"),
    )


if __name__ == "__main__":
    main()
