"""How the operator runs: over which namespaces, and which of its replicas is active.

Several replicas run at once for availability; kopf's peering (``kopf run --peering``) lets
only the one of highest priority handle objects while the others stand by, and a stand-by
takes over once the active one leaves the peering object or stops renewing it (its
``lifetime``). kopf pauses *every* replica when two share the highest priority, so each
replica takes its start time in microseconds as its priority: the newest one leads, which in
a rolling update is the new version. The tuner runs outside kopf's handlers (see
handlers.tuner_loop), so it asks ``leads`` itself, from the same peering object.
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda_operator import constants as c

KOPF_GROUP_VERSION = "kopf.dev/v1"
# kopf names a peer by $POD_ID where set (the chart sets it to the pod's name).
IDENTITY_ENV = "POD_ID"
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


@dataclass(frozen=True)
class RunOptions:
    """``namespaces`` empty: every namespace. ``peering`` None: a lone replica (standalone)."""

    namespaces: tuple[str, ...] = ()
    peering: str | None = None
    priority: int = 0
    identity: str = ""
    liveness: str = DEFAULT_LIVENESS
    verbose: bool = False


def parse_run_options(argv: Sequence[str], environ: dict[str, str]) -> RunOptions:
    parser = argparse.ArgumentParser(prog="python -m pagoda_operator")
    parser.add_argument(
        "--namespace", action="append", default=[], metavar="NAME",
        help="watch only this namespace (repeat for several); none: every namespace",
    )  # fmt: skip
    parser.add_argument(
        "--peering", metavar="NAME",
        help="the kopf peering object shared by the replicas; none: run standalone",
    )  # fmt: skip
    args = parser.parse_args(list(argv))
    return RunOptions(
        namespaces=tuple(dict.fromkeys(args.namespace)),
        peering=args.peering,
        priority=time.time_ns() // 1000,
        identity=environ.get(IDENTITY_ENV, ""),
        liveness=environ.get("PAGODA_LIVENESS_ENDPOINT", DEFAULT_LIVENESS),
        verbose=environ.get("PAGODA_OPERATOR_VERBOSE") == "1",
    )


def kopf_run_arguments(options: RunOptions) -> dict[str, Any]:
    """Keyword arguments of kopf.run for these options."""
    return {
        "standalone": options.peering is None,
        "peering_name": options.peering,
        "priority": options.priority if options.peering else None,
        "clusterwide": not options.namespaces,
        "namespaces": list(options.namespaces),
        "liveness_endpoint": options.liveness,
    }


def peering_path(options: RunOptions, namespace: str) -> str:
    """The peering object kopf keeps for this namespace (cluster-wide: the cluster's)."""
    if options.namespaces:
        return f"/apis/{KOPF_GROUP_VERSION}/namespaces/{namespace}/kopfpeerings/{options.peering}"
    return f"/apis/{KOPF_GROUP_VERSION}/clusterkopfpeerings/{options.peering}"


def leads(
    peering_status: dict[str, Any] | None,
    identity: str,
    priority: int,
    now: datetime.datetime | None = None,
) -> bool:
    """Whether this replica is the one kopf lets act: no other live peer has its priority
    or a higher one (the rule of kopf's peering: the highest priority acts, equals all pause).
    A peer is live until ``lastseen + lifetime``."""
    now = now or datetime.datetime.now(datetime.UTC)
    for peer_id, peer in (peering_status or {}).items():
        if peer_id == identity or not isinstance(peer, dict):
            continue
        lastseen = peer.get("lastseen")
        seen = datetime.datetime.fromisoformat(lastseen) if lastseen else now
        if seen + datetime.timedelta(seconds=int(peer.get("lifetime", 60))) <= now:
            continue  # dead: kopf ignores it too
        if int(peer.get("priority", 0)) >= priority:
            return False
    return True


async def led_llmdeployments(client: Any, options: RunOptions) -> list[dict[str, Any]]:
    """The LLMDeployments this replica acts on: those of the watched namespaces, where it
    leads the peering. API errors propagate (the caller tries again next round)."""
    items: list[dict[str, Any]] = []
    for namespace in options.namespaces or ("",):
        if options.peering:
            peering = await client.get(peering_path(options, namespace))
            if not leads((peering or {}).get("status"), options.identity, options.priority):
                continue
        scope = f"/namespaces/{namespace}" if namespace else ""
        listed = await client.get(f"/apis/{c.API_VERSION}{scope}/{c.PLURAL}")
        items += (listed or {}).get("items") or []
    return items
