"""``python -m pagoda_operator [--namespace NAME ...] [--peering NAME]``: the operator with a
liveness endpoint, over every namespace or only those named, standalone or as one of
several replicas of which one acts (see peering.py)."""

import os
import sys

import kopf

from pagoda_operator import handlers  # noqa: F401  (registers the handlers)
from pagoda_operator.peering import kopf_run_arguments, parse_run_options


def main() -> None:
    options = parse_run_options(sys.argv[1:], dict(os.environ))
    kopf.configure(verbose=options.verbose)
    kopf.run(memo=kopf.Memo(run_options=options), **kopf_run_arguments(options))


if __name__ == "__main__":
    main()
