"""The tuner's decision: one window of metrics in, at most one knob change out.

Pure: the operator (``runner``), the simulator and the tests all call ``decide`` with plain
values and a plain-dict ``state`` that lives in ``status.tuning.state`` between windows.

What keeps it steady:

- hysteresis: a condition must hold for several consecutive windows before it acts, and the
  thresholds that push a knob up and down are far apart, so noise around one cannot trigger
  the other;
- a cooldown after every change, which also waits for the rollout to finish and for one full
  window of metrics after it, so a change is never judged on a replica still loading; once
  the change is judged, changes that add capacity may act inside it (nothing can flap
  then), the rest wait for its end;
- engine knobs that restart every engine move ahead of the load where they can: a bigger
  batch is made in a calm window when the KV cache holds far more sequences than the
  slots allow, so that it is there before a peak fills the slots;
- step limits (maxNumSeqs at most doubles or halves, gpuMemoryUtilization moves 0.02,
  replicas at most double going up and drop by one going down);
- one knob at a time, never outside the user's bounds, never a knob the user pinned;
- a change that made things worse is reverted and its value is not tried again for a while,
  and so is one whose rollout fails (engines restarting, or not done by a deadline);
  a knob that moved one way does not move back the other way until a dwell has passed.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

from pagoda_operator.tuning.judge import watch_pending
from pagoda_operator.tuning.model import (  # noqa: F401  (re-exported: the policy's vocabulary)
    DEFAULT_CONFIG,
    GPU_MEMORY_UTILIZATION,
    KNOBS,
    MAX_NUM_SEQS,
    REPLICAS,
    Action,
    Decision,
    Limits,
    PolicyConfig,
    Proposal,
    Snapshot,
    direction,
    fmt,
    record_move,
)


def empty_state() -> dict[str, Any]:
    return {
        "streaks": {
            "overload": 0,
            "idle": 0,
            "preempting": 0,
            "kvBound": 0,
            "kvBusy": 0,
            "calm": 0,
            "nearTarget": 0,
            "busy": 0,
            "queued": 0,
        },
        # Requests/s one engine served in the last window it was saturated (see _saturated).
        "capacity": None,
        "pending": None,
        # An engine-knob change waiting for (or rolling out on) engines added to cover its
        # rollout; see _cover_engines and _covered.
        "cover": None,
        "lastChangeTime": None,
        "lastMove": {},
        "rejected": [],
        "lastOomTime": None,
        "lastKvUsage": None,
    }


def decide(
    snapshot: Snapshot | None,
    settings: dict[str, float],
    limits: Limits,
    state: dict[str, Any] | None,
    *,
    now: float,
    mode: str,
    rollout_complete: bool = True,
    problem: str = "",
    config: PolicyConfig = DEFAULT_CONFIG,
) -> tuple[Decision, dict[str, Any]]:
    """This window's decision and the state to keep for the next one.

    ``mode`` is ``Recommend`` (nothing is applied: no cooldown, no change to watch) or
    ``Auto`` (the caller applies a change or revert at once; the state then watches it).
    """
    state = _normalized(state)
    if snapshot is None:
        if mode == "Auto" and state["pending"] is not None:
            # Engines that crash at start-up report nothing: the deadline still runs.
            outcome = watch_pending(None, limits, state, now, rollout_complete, config)
            if isinstance(outcome, Decision) and outcome.action == "revert":
                if state["cover"] is not None and state["cover"]["phase"] == "adding":
                    state["cover"] = None  # the engines never came: the change is not made
                return outcome, state
        return Decision("hold", f"holding steady: {problem or 'no metrics'}"), state
    if rollout_complete and (mode != "Auto" or _unchanging(state["pending"], snapshot, now)):
        # Only a window in which every engine served throughout says what one can do: none
        # while a change rolls out, but the full window after it that judges it does.
        state["capacity"] = _updated_capacity(
            state["capacity"], snapshot, state["streaks"]["queued"], now, limits, config
        )
    capacity = _usable_capacity(state["capacity"], snapshot, config)
    kv_next = _projected_kv(snapshot, state["lastKvUsage"])
    state["lastKvUsage"] = snapshot.kv_cache_usage
    state["streaks"] = _updated_streaks(
        state["streaks"], snapshot, limits, capacity, kv_next, config
    )
    if snapshot.oom_kills:
        state["lastOomTime"] = now
    state["rejected"] = [r for r in state["rejected"] if r["until"] > now]
    verdict = None
    if mode != "Auto":
        state["pending"] = state["cover"] = None
    elif state["cover"] is not None and state["cover"]["phase"] == "adding":
        return _covered(snapshot, settings, limits, state, now, rollout_complete, config), state
    elif state["pending"] is not None:
        outcome = watch_pending(snapshot, limits, state, now, rollout_complete, config)
        if isinstance(outcome, Decision):
            return outcome, state
        verdict = outcome
    if mode == "Auto" and state["cover"] is not None and state["pending"] is None:
        give_back = _give_back(snapshot, settings, state, now, verdict, config)
        if give_back is not None:
            return give_back, state
    urgent_only = False
    if mode == "Auto" and state["lastChangeTime"] is not None:
        remaining = limits.cooldown_s - (now - state["lastChangeTime"])
        urgent_only = remaining > 0
        if urgent_only and not _escalate(state):
            return Decision("hold", f"cooldown: {remaining:.0f}s left", verdict=verdict), state
    proposal, blocked = _first_proposal(
        snapshot, settings, limits, state, now, kv_next, config, urgent_only
    )
    if proposal is None and urgent_only:
        return Decision("hold", f"cooldown: {remaining:.0f}s left", verdict=verdict), state
    if proposal is None:
        reason = f"holding: {blocked}" if blocked else _steady_reason(snapshot, limits)
        return Decision("hold", reason, verdict=verdict), state
    if mode == "Auto" and proposal.cover:
        return _add_cover(proposal, snapshot, settings, state, now, verdict), state
    old = settings[proposal.knob]
    reason = proposal.reason
    if proposal.cover:
        reason += f" (once {proposal.cover} engines more are Ready to cover its rollout)"
    decision = Decision("change", reason, proposal.knob, old, proposal.new, verdict)
    if mode == "Auto":
        state["pending"] = {
            "knob": proposal.knob,
            "from": old,
            "to": proposal.new,
            "time": now,
            "settledTime": None,
            "baseline": snapshot.summary(),
        }
        record_move(state, proposal.knob, old, proposal.new, now)
    return decision, state


# ----- covered rollouts ------------------------------------------------------------------


def _add_cover(
    proposal: Proposal,
    snapshot: Snapshot,
    settings: dict[str, float],
    state: dict[str, Any],
    now: float,
    verdict: str | None,
) -> Decision:
    """The first step of a covered engine-knob change: the engines its rollout takes down
    are added now; the change itself waits for them (``_covered``). Not a tuning move of
    replicas (no cooldown, no dwell): the engines go back once the change is judged."""
    replicas = settings[REPLICAS]
    change = f"{proposal.knob} {fmt(settings[proposal.knob])} -> {fmt(proposal.new)}"
    state["cover"] = {
        "phase": "adding",
        "knob": proposal.knob,
        "from": settings[proposal.knob],
        "to": proposal.new,
        "reason": proposal.reason,
        "engines": proposal.cover,
        "replicas": replicas + proposal.cover,
        # The window before the cover, every engine serving all of it: the change is
        # judged per engine against it.
        "baseline": snapshot.summary(),
    }
    state["pending"] = {
        "knob": REPLICAS,
        "from": replicas,
        "to": replicas + proposal.cover,
        "time": now,
        "settledTime": None,
        "baseline": snapshot.summary(),
        "cover": True,
    }
    reason = (
        f"{proposal.cover} engines added to cover the rollout of {change}, which takes "
        f"{proposal.cover} down at a time; the change follows once they are Ready: "
        f"{proposal.reason}"
    )
    return Decision("change", reason, REPLICAS, replicas, replicas + proposal.cover, verdict)


def _covered(
    snapshot: Snapshot | None,
    settings: dict[str, float],
    limits: Limits,
    state: dict[str, Any],
    now: float,
    rollout_complete: bool,
    config: PolicyConfig,
) -> Decision:
    """While the engines added to cover a change start: hold (or revert them when they do
    not come up by the deadline); once they are Ready, the change, unless it is no longer
    allowed or the load has risen so that the replica rules want the engines (they stay)."""
    cover = state["cover"]
    if not rollout_complete or snapshot is None:
        outcome = watch_pending(snapshot, limits, state, now, rollout_complete, config)
        assert isinstance(outcome, Decision)  # a rollout under way is never judged
        if outcome.action == "revert":
            state["cover"] = None
        return outcome
    state["pending"] = None
    state["cover"] = None
    change = f"{cover['knob']} {fmt(cover['from'])} -> {fmt(cover['to'])}"
    ready = f"{cover['engines']} engines added to cover the rollout of {change} Ready"
    if state["streaks"]["overload"] or state["streaks"]["nearTarget"]:
        return Decision(
            "hold",
            f"the {cover['engines']} engines added to cover {change} are Ready, but the load "
            f"rose meanwhile: they stay, and {cover['knob']} stays until the next calm",
            verdict=f"{ready}; they stay: the load rose meanwhile",
        )
    allowed = _allowed(
        Proposal(cover["knob"], cover["to"], cover["reason"]), settings, limits, state, now, config
    )
    if isinstance(allowed, str) or settings[cover["knob"]] != cover["from"]:
        why = allowed if isinstance(allowed, str) else f"{cover['knob']} changed meanwhile"
        return Decision("hold", f"{change} not made: {why}", verdict=f"{ready}; they stay")
    state["cover"] = {**cover, "phase": "rolling"}
    state["pending"] = {
        "knob": cover["knob"],
        "from": cover["from"],
        "to": allowed.new,
        "time": now,
        "settledTime": None,
        "baseline": cover["baseline"],
    }
    record_move(state, cover["knob"], cover["from"], allowed.new, now)
    return Decision(
        "change",
        f"the {cover['engines']} engines added to cover its rollout are Ready: {cover['reason']}",
        cover["knob"],
        cover["from"],
        allowed.new,
        verdict=ready,
    )


def _give_back(
    snapshot: Snapshot,
    settings: dict[str, float],
    state: dict[str, Any],
    now: float,
    verdict: str | None,
    config: PolicyConfig,
) -> Decision | None:
    """Once a covered change has been judged, its engines go back, unless the replica rules
    want them by then (the engines left would run near their limits: TTFT near the target,
    a queue, busy slots or cache, or demand near the saturated rate measured) or the
    replicas moved meanwhile. None when they stay: the window goes on to the rules."""
    cover, state["cover"] = state["cover"], None
    if settings[REPLICAS] != cover["replicas"]:
        return None
    streaks = state["streaks"]
    if any(streaks[name] for name in ("overload", "nearTarget", "busy", "kvBusy", "queued")):
        return None
    pods_after = snapshot.pods - cover["engines"]
    if pods_after < 1:
        return None
    spread = snapshot.pods / pods_after
    seqs = settings[MAX_NUM_SEQS]
    if (
        snapshot.requests_running / snapshot.pods * spread > config.busy_fraction * seqs
        or snapshot.kv_cache_usage * spread > config.kv_headroom
    ):
        return None
    capacity = _usable_capacity(state["capacity"], snapshot, config)
    if capacity is not None and demand_per_s(snapshot) > (
        pods_after * capacity * config.scale_up_utilization
    ):
        return None
    replicas = settings[REPLICAS]
    state["pending"] = {
        "knob": REPLICAS,
        "from": replicas,
        "to": replicas - cover["engines"],
        "time": now,
        "settledTime": None,
        "baseline": snapshot.summary(),
    }
    change = f"{cover['knob']} {fmt(cover['from'])} -> {fmt(cover['to'])}"
    return Decision(
        "change",
        f"giving back the {cover['engines']} engines added to cover the rollout of {change}, "
        f"now judged; {pods_after} engines hold the load",
        REPLICAS,
        replicas,
        replicas - cover["engines"],
        verdict,
    )


# ----- rules ----------------------------------------------------------------------------


def _escalate(state: dict[str, Any]) -> bool:
    """Whether this window may act before the cooldown ends: the last change has been
    judged. The cooldown is there to judge a change and to keep the knobs steady under
    noise; the first is done once the change is judged, and the second needs no more than
    the rules' own hysteresis for a change that adds capacity (none takes it away inside
    the cooldown, so nothing can flap). Holding those back would leave users without
    service for the rest of it: the demand a calm window's engine-knob change was made
    ahead of, a cache filling, a ramp outrunning the engines. Only changes that add
    capacity are allowed then."""
    return state["pending"] is None


def _urgent(proposal: Proposal, settings: dict[str, float]) -> bool:
    """A change that adds capacity: more replicas, or fewer sequences per engine under
    preemptions (each preemption recomputes a whole context)."""
    lower_seqs = proposal.knob == MAX_NUM_SEQS and proposal.new < settings[MAX_NUM_SEQS]
    more_replicas = proposal.knob == REPLICAS and proposal.new > settings[REPLICAS]
    return lower_seqs or more_replicas


def _updated_capacity(
    capacity: dict[str, float] | None,
    snapshot: Snapshot,
    queued_before: int,
    now: float,
    limits: Limits,
    config: PolicyConfig,
) -> dict[str, float] | None:
    """An engine's saturated rate: what it served while requests queued. It is forgotten
    when the prompts change a lot (see ``_usable_capacity``) and when it grows old."""
    pods = max(snapshot.pods, 1)
    if _saturated(snapshot, queued_before, limits, config) and snapshot.requests_per_s > 0:
        # A queue on some engines but not all still counts here, so one window tends to
        # understate the rate: keep the best one seen for the same kind of requests.
        rate = snapshot.requests_per_s / pods
        rate = max(rate, _usable_capacity(capacity, snapshot, config) or 0.0)
        return {
            "requestsPerPod": rate,
            "promptTokensPerRequest": _prompt_length(snapshot),
            "time": now,
        }
    if capacity and now - capacity["time"] > config.capacity_memory_cooldowns * limits.cooldown_s:
        return None
    return capacity


def _unchanging(pending: dict[str, Any] | None, snapshot: Snapshot, now: float) -> bool:
    """No change under watch, or this is the full window after its rollout that judges it."""
    if pending is None:
        return True
    settled = pending.get("settledTime")
    return settled is not None and now - settled >= snapshot.window_s


def _saturated(
    snapshot: Snapshot, queued_before: int, limits: Limits, config: PolicyConfig
) -> bool:
    """Whether the engines served all they could in this window: a queue that is not
    shrinking and has lasted ``windows_up`` windows (``queued_before`` counts the ones
    before this), or one with clients giving up or TTFT far over target.

    A queue that a Poisson burst forms at high but sustainable load is there one window
    and gone the next: the rate served then is the demand, not the engines' limit, and
    taking it for the limit has the tuner add replicas the load does not need. While a
    backlog drains, the requests that finish were admitted windows earlier, so the rate
    finished then overstates what an engine sustains (and so does its prompt length)."""
    if snapshot.requests_waiting / max(snapshot.pods, 1) < config.queue_per_pod:
        return False
    if snapshot.queue_growth_per_s < 0:
        return False
    return queued_before + 1 >= config.windows_up or _severe(snapshot, limits, config)


def _severe(snapshot: Snapshot, limits: Limits, config: PolicyConfig) -> bool:
    """Clients giving up, or TTFT far over target: no noise to filter, one window is enough."""
    return snapshot.aborted_per_s / max(snapshot.pods, 1) >= config.aborts_per_pod_s or (
        snapshot.ttft_p95_s is not None
        and snapshot.ttft_p95_s > config.severe_ttft_factor * limits.ttft_target_s
    )


def _usable_capacity(
    capacity: dict[str, float] | None, snapshot: Snapshot, config: PolicyConfig
) -> float | None:
    """The saturated rate, unless the prompts changed so much since it was measured that
    it no longer says what an engine can do (a shift to long contexts, say)."""
    if not capacity:
        return None
    then, now = capacity.get("promptTokensPerRequest") or 0.0, _prompt_length(snapshot)
    if then > 0 and now > 0 and max(then, now) / min(then, now) > config.prompt_shift_ratio:
        return None
    return capacity["requestsPerPod"]


def _prompt_length(snapshot: Snapshot) -> float:
    if snapshot.requests_per_s <= 0:
        return 0.0
    return snapshot.prompt_tokens_per_s / snapshot.requests_per_s


def demand_per_s(snapshot: Snapshot) -> float:
    """Requests/s arriving: served, given up on, and added to the queue."""
    return max(0.0, snapshot.requests_per_s + snapshot.aborted_per_s + snapshot.queue_growth_per_s)


def _projected_kv(snapshot: Snapshot, before: float | None) -> float:
    """The KV cache usage one window ahead if it keeps rising as it did in this one."""
    if before is None:
        return snapshot.kv_cache_usage
    return snapshot.kv_cache_usage + max(0.0, snapshot.kv_cache_usage - before)


def _updated_streaks(
    streaks: dict[str, int],
    snapshot: Snapshot,
    limits: Limits,
    capacity: float | None,
    kv_next: float,
    config: PolicyConfig,
) -> dict[str, int]:
    """Consecutive windows for which each condition held; a window without it resets it."""
    pods = max(snapshot.pods, 1)
    waiting_per_pod = snapshot.requests_waiting / pods
    ttft = snapshot.ttft_p95_s
    preempting = snapshot.preemptions_per_s / pods >= config.preemptions_per_pod_s
    queued = waiting_per_pod >= config.queue_per_pod
    overload = queued or (ttft is not None and ttft > limits.ttft_target_s)
    kv_bound = snapshot.kv_cache_usage >= config.kv_bound and (
        waiting_per_pod >= config.queue_per_pod or preempting
    )
    idle = (
        waiting_per_pod <= config.idle_queue_per_pod
        and (ttft is None or ttft < config.idle_ttft_fraction * limits.ttft_target_s)
        and snapshot.preemptions_per_s == 0
    )
    busy = capacity is not None and demand_per_s(snapshot) / pods >= (
        config.busy_utilization * capacity
    )
    # Filling without preemptions yet (with them, the batch is what outgrows the cache).
    kv_busy = not preempting and (
        snapshot.kv_cache_usage >= config.kv_busy or _filling_fast(snapshot, kv_next, config)
    )
    # Nothing waiting, nothing preempted, TTFT well within target: a window in which engines
    # can restart one by one for a better balance of batch and cache (see _balance).
    calm = (
        not queued
        and not preempting
        and snapshot.requests_running > 0
        and (ttft is None or ttft <= config.idle_ttft_fraction * limits.ttft_target_s)
    )
    near_target = ttft is not None and ttft > config.near_ttft_fraction * limits.ttft_target_s
    conditions = {
        "overload": overload,
        "idle": idle,
        "preempting": preempting,
        "kvBound": kv_bound,
        "kvBusy": kv_busy,
        "calm": calm,
        "nearTarget": near_target,
        "busy": busy,
        "queued": queued,
    }
    return {name: (streaks.get(name, 0) + 1 if held else 0) for name, held in conditions.items()}


def _filling_fast(snapshot: Snapshot, kv_next: float, config: PolicyConfig) -> bool:
    """Past kv_headroom and, at this window's pace, past kv_bound by the next: no time for
    hysteresis (a cache that fills admits no one, or preempts)."""
    usage = snapshot.kv_cache_usage
    return usage >= config.kv_headroom and kv_next >= config.kv_bound and kv_next > usage


def _first_proposal(
    snapshot: Snapshot,
    settings: dict[str, float],
    limits: Limits,
    state: dict[str, Any],
    now: float,
    kv_next: float,
    config: PolicyConfig,
    urgent_only: bool = False,
) -> tuple[Proposal | None, str]:
    """The first rule, in order of urgency, whose change is allowed (only those that add
    capacity when ``urgent_only``); else None and why the most urgent one was not."""
    blocked = ""
    for candidate in _candidates(snapshot, settings, limits, state, now, kv_next, config):
        if urgent_only and not _urgent(candidate, settings):
            continue
        allowed = _allowed(candidate, settings, limits, state, now, config)
        if isinstance(allowed, Proposal):
            return allowed, ""
        blocked = blocked or f"{candidate.reason}, but {allowed}"
    return None, blocked


def _candidates(
    snapshot: Snapshot,
    settings: dict[str, float],
    limits: Limits,
    state: dict[str, Any],
    now: float,
    kv_next: float,
    config: PolicyConfig,
) -> list[Proposal]:
    streaks = state["streaks"]
    seqs, memory, replicas = (
        settings[MAX_NUM_SEQS],
        settings[GPU_MEMORY_UTILIZATION],
        settings[REPLICAS],
    )
    candidates: list[Proposal] = []
    if (snapshot.oom_kills or 0) > 0:
        why = f"{fmt(snapshot.oom_kills)} OOM kills in the last window"
        candidates.append(
            Proposal(GPU_MEMORY_UTILIZATION, round(memory - config.gpu_memory_step, 4), why)
        )
        candidates.append(Proposal(MAX_NUM_SEQS, _halved(seqs, config), why))
        return candidates
    last_oom = state["lastOomTime"]
    recent_oom = last_oom is not None and now - last_oom < config.oom_memory_cooldowns * (
        limits.cooldown_s
    )
    storm = snapshot.preemptions_per_s / max(snapshot.pods, 1) >= (
        config.storm_preemptions_per_pod_s
    )
    if streaks["preempting"] >= config.windows_preempting or (streaks["preempting"] and storm):
        candidates.append(
            Proposal(
                MAX_NUM_SEQS,
                _fitted_to_cache(snapshot, seqs, config),
                f"{snapshot.preemptions_per_s:.3g} preemptions/s for "
                f"{streaks['preempting']} windows: the batch outgrows the KV cache",
            )
        )
    # A full cache with a queue asks for more memory; one with preemptions first for fewer
    # sequences (above), which ends the recomputation where a few % more cache would not.
    if streaks["kvBound"] >= config.windows_up and not recent_oom and not streaks["preempting"]:
        if snapshot.oom_kills is not None:
            candidates.append(
                Proposal(
                    GPU_MEMORY_UTILIZATION,
                    round(memory + config.gpu_memory_step, 4),
                    f"KV cache {snapshot.kv_cache_usage:.0%} full with a queue or preemptions "
                    f"for {streaks['kvBound']} windows; no OOM kills seen",
                )
            )
    capacity = _usable_capacity(state["capacity"], snapshot, config)
    severe = _severe(snapshot, limits, config)
    if streaks["overload"] >= config.windows_up or (streaks["overload"] and severe):
        candidates += _overload_candidates(snapshot, seqs, replicas, limits, capacity, config)
    elif streaks["busy"] >= config.windows_up:
        load = demand_per_s(snapshot) / max(snapshot.pods, 1) / (capacity or 1.0)
        why = f"demand at {load:.0%} of the engines' saturated rate"
        scale_up = _scale_up(snapshot, replicas, why, capacity, config)
        candidates += [scale_up] if scale_up is not None else []
    elif streaks["kvBusy"] >= config.windows_up or (
        streaks["kvBusy"] and _filling_fast(snapshot, kv_next, config)
    ):
        # Sequences that live long fill the cache before compute or slots run out: when it
        # is full, requests queue for it (or are preempted). Add engines before that, enough
        # to bring the cache back to kv_headroom.
        wanted = math.ceil(snapshot.pods * snapshot.kv_cache_usage / config.kv_headroom)
        new = min(max(wanted, replicas + 1), config.max_scale_up_factor * replicas)
        candidates.append(Proposal(
            REPLICAS, new,
            f"KV cache {snapshot.kv_cache_usage:.0%} full (next window at this pace: "
            f"{min(kv_next, 1.0):.0%}) for {streaks['kvBusy']} windows: "
            f"{new:g} engines hold it at {snapshot.kv_cache_usage * snapshot.pods / new:.0%}",
        ))  # fmt: skip
    elif streaks["nearTarget"] >= config.windows_up:
        ttft = snapshot.ttft_p95_s or 0.0
        candidates.append(Proposal(
            REPLICAS, replicas + 1,
            f"TTFT p95 {ttft:.3g}s at {ttft / limits.ttft_target_s:.0%} of the "
            f"{limits.ttft_target_s:g}s target for {streaks['nearTarget']} windows",
        ))  # fmt: skip
    if streaks["calm"] >= config.windows_up:
        candidates += _balance(snapshot, seqs, replicas, limits, capacity, config)
    if streaks["idle"] >= config.windows_down and snapshot.pods > 1:
        scale_down = _scale_down(snapshot, replicas, capacity, config)
        if scale_down is not None:
            candidates.append(scale_down)
    return candidates


def _balance(
    snapshot: Snapshot,
    seqs: float,
    replicas: float,
    limits: Limits,
    capacity: float | None,
    config: PolicyConfig,
) -> list[Proposal]:
    """In a calm window, a bigger batch when the KV cache holds ``min_max_num_seqs_raise``
    times ``maxNumSeqs`` or more at ``kv_headroom`` (at the KV each running sequence holds
    now): the slots, not the cache, will be the limit when the load rises, and a bigger
    batch serves more on the same GPU then (a sequence adds ~11.5 us to a decode step of
    ~4 ms). Made ahead of the demand because every engine restarts to take it: in the
    overload that would show the slots full, the rollout costs serving capacity (with
    maxUnavailable 1) or holds every other change until it has rolled out and been judged.
    Only while the engines left serving through the rollout carry the load with room (with
    the engines it takes down added first where replicas can grow: ``_cover_engines``),
    and the ITL is well within its target."""
    pods = max(snapshot.pods, 1)
    running = snapshot.requests_running / pods
    high = limits.bounds.get(MAX_NUM_SEQS, (seqs, seqs))[1]
    if running <= 0 or snapshot.kv_cache_usage <= 0 or seqs >= high:
        return []
    itl_ok = (
        limits.itl_target_s is None
        or snapshot.itl_p95_s is None
        or snapshot.itl_p95_s < 0.5 * limits.itl_target_s
    )
    if not itl_ok:
        return []
    # Engines are lent to the rollout only where those left serving are not known to carry
    # the load (no saturated rate measured, or one too close): a GPU is not spent for nothing.
    cover = 0
    if not _rollout_carried_calm(snapshot, seqs, limits, capacity, 0, config):
        cover = _cover_engines(replicas, limits)
        if not cover or not _rollout_carried_calm(snapshot, seqs, limits, capacity, cover, config):
            return []
    new = _batch_that_fits(snapshot, seqs, config)
    if new < config.min_max_num_seqs_raise * seqs:
        return []
    fill = snapshot.kv_cache_usage * new / running
    return [Proposal(
        MAX_NUM_SEQS, new,
        f"calm for {config.windows_up}+ windows with KV cache at "
        f"{snapshot.kv_cache_usage:.0%}: {new} sequences an engine fill {fill:.0%} of it, "
        f"{fmt(seqs)} slots would be the limit when the load rises",
        cover,
    )]  # fmt: skip


def _rollout_carried_calm(
    snapshot: Snapshot,
    seqs: float,
    limits: Limits,
    capacity: float | None,
    cover: int,
    config: PolicyConfig,
) -> bool:
    """Whether the engines left serving while a knob change rolls out (``maxUnavailable``
    fewer, ``cover`` added before it) hold what all of them hold now with room: their
    slots under ``busy_fraction``, their cache under ``kv_headroom``, and the demand within
    ``scale_up_utilization`` of the saturated rate measured. A rollout that surges with
    maxUnavailable 0 loses none, and neither does one whose engines are covered."""
    pods = max(snapshot.pods, 1)
    down = pods if limits.rollout_unavailable is None else min(limits.rollout_unavailable, pods)
    down = max(0, down - cover)
    if down == 0:
        return True
    left = pods - down
    if left <= 0:
        return False
    spread = pods / left
    slots_ok = snapshot.requests_running / pods * spread <= config.busy_fraction * seqs
    cache_ok = snapshot.kv_cache_usage * spread <= config.kv_headroom
    # Slots and cache say nothing of compute (an engine's rate saturates long before its
    # slots fill): without a saturated rate measured, one engine fewer is a guess.
    rate_ok = capacity is not None and demand_per_s(snapshot) <= (
        left * capacity * config.scale_up_utilization
    )
    return slots_ok and cache_ok and rate_ok


def _cover_engines(replicas: float, limits: Limits) -> int:
    """Engines to add, and have Ready, before a calm engine-knob change rolls out, when the
    engines left serving through it are not known to carry the load: as many as its
    rollout takes down at once (maxUnavailable), as far as replicas may grow. Then
    the Deployment, at its new size with maxUnavailable k, keeps the engines that served
    before ready throughout (it stops an old engine only while that many stay ready): a
    surge the user's rollout does not have, lent for the rollout and given back once the
    change is judged. Without a measured saturated rate, that is the only way to know the
    engines left serving carry the load. None for Recreate: it stops every engine, however
    many there are; none when replicas are not the tuner's to move."""
    unavailable = limits.rollout_unavailable
    if unavailable is None or unavailable == 0 or REPLICAS not in limits.bounds:
        return 0
    room = int(limits.bounds[REPLICAS][1] - replicas)
    return max(0, min(unavailable, room))


def _fitted_to_cache(snapshot: Snapshot, seqs: float, config: PolicyConfig) -> int:
    """Under preemptions: as many sequences as would fill ``kv_headroom`` of the KV cache
    (the running ones filled ``kv_cache_usage`` of it; the rest is room for them to grow),
    and at least one fewer. A recompute preemption redoes a whole context, so a batch that
    fits serves more than one that thrashes."""
    running = snapshot.requests_running / max(snapshot.pods, 1)
    usage = max(snapshot.kv_cache_usage, 1e-9)
    fits = math.floor(running * config.kv_headroom / usage)
    return max(1, min(int(seqs) - 1, fits))


def _scale_down(
    snapshot: Snapshot,
    replicas: float,
    capacity: float | None,
    config: PolicyConfig,
) -> Proposal | None:
    """One replica less, when the others would still run well below the saturated rate
    measured for these requests. Without one there is no scale-down: batch slots say
    nothing of an engine's compute (it saturates long before they fill), so removing a
    replica by them is a probe that breaks the SLO when it is wrong."""
    if capacity is None:
        return None
    pods_after = snapshot.pods - 1
    load_after = demand_per_s(snapshot) / pods_after / capacity
    kv_after = snapshot.kv_cache_usage * snapshot.pods / pods_after
    if load_after > config.scale_down_utilization or kv_after > config.kv_headroom:
        return None
    why = (f"idle for {snapshot.window_s:g}s windows: {pods_after} engines would run at "
           f"{load_after:.0%} of their saturated rate")  # fmt: skip
    return Proposal(REPLICAS, replicas - 1, why)


def _overload_candidates(
    snapshot: Snapshot,
    seqs: float,
    replicas: float,
    limits: Limits,
    capacity: float | None,
    config: PolicyConfig,
) -> list[Proposal]:
    pods = max(snapshot.pods, 1)
    why = _overload_reason(snapshot, limits)
    candidates = []
    running = snapshot.requests_running / pods
    slots_full = running >= config.busy_fraction * seqs
    itl_ok = (
        limits.itl_target_s is None
        or snapshot.itl_p95_s is None
        or snapshot.itl_p95_s < 0.5 * limits.itl_target_s
    )
    # Every slot busy and requests waiting, whatever the queue's length: a bigger batch
    # serves more on the same GPU (a sequence adds ~11.5 us to a decode step of ~4 ms; a
    # replica costs a GPU), so it comes first, as far as the cache measured says it fits.
    # But every engine restarts to take it: with the default rollout (maxUnavailable 1)
    # one engine fewer serves while it rolls out, which deepens an overload that more
    # engines would relieve. So it comes first only when the engines left serving carry the
    # demand meanwhile, or replicas cannot grow. A rollout that surges with maxUnavailable
    # 0 takes none away, but it still holds every other change until it has rolled out and
    # been judged (minutes): in a severe overload each of those windows misses the SLO, and
    # engines, which start at once, come first.
    waiting = snapshot.requests_waiting > 0
    can_add = REPLICAS in limits.bounds and replicas < limits.bounds[REPLICAS][1]
    per_pod = capacity or snapshot.requests_per_s / pods
    down = pods if limits.rollout_unavailable is None else min(limits.rollout_unavailable, pods)
    severe = _severe(snapshot, limits, config)
    carried = (
        (down == 0 and not severe)
        or (pods - down) * per_pod >= demand_per_s(snapshot)
        or not can_add
    )
    if slots_full and waiting and carried and snapshot.preemptions_per_s == 0 and itl_ok:
        new = _batch_that_fits(snapshot, seqs, config)
        if new >= config.min_max_num_seqs_raise * seqs:
            candidates.append(
                Proposal(
                    MAX_NUM_SEQS,
                    new,
                    f"{why}; every batch slot busy with KV cache at "
                    f"{snapshot.kv_cache_usage:.0%}: {new} sequences fill "
                    f"{snapshot.kv_cache_usage * new / max(running, 1e-9):.0%} of it",
                )
            )
    # Clients giving up or TTFT far over target: the demand measured is added at once, up
    # to the bound, not at most max_scale_up_factor times as many.
    ceiling = limits.bounds.get(REPLICAS, (replicas, replicas))[1] if severe else None
    scale_up = _scale_up(snapshot, replicas, why, capacity, config, ceiling)
    return candidates + ([scale_up] if scale_up is not None else [])


def _batch_that_fits(snapshot: Snapshot, seqs: float, config: PolicyConfig) -> int:
    """A bigger batch (at most ``max_num_seqs_factor`` times this one) whose sequences, at
    the KV each running one holds now, fill at most ``kv_headroom`` of the cache; ``seqs``
    when none fit."""
    running = snapshot.requests_running / max(snapshot.pods, 1)
    if running <= 0:
        return int(seqs)
    fits = math.floor(running * config.kv_headroom / max(snapshot.kv_cache_usage, 1e-9))
    return int(max(seqs, min(fits, math.floor(seqs * config.max_num_seqs_factor))))


def _scale_up(
    snapshot: Snapshot,
    replicas: float,
    why: str,
    capacity: float | None,
    config: PolicyConfig,
    ceiling: float | None = None,
) -> Proposal | None:
    """Enough replicas for the demand at the rate each engine serves now, saturated.

    Demand is what was served, what clients gave up on and what the queue grew by; the
    queue's length itself is not demand (it says how long requests wait, not how many
    arrive), so a long backlog does not inflate the count. At most ``max_scale_up_factor`` times as many engines, so
    one noisy window cannot ask for many, unless a ``ceiling`` is given (clients giving
    up, TTFT far over target): each window short is then one more the SLO misses (a burst
    that tripled the rate from 2 engines took two looks at the cap: 4 missed windows
    where 3 remain), and the queue to drain counts too.
    """
    demand = demand_per_s(snapshot)
    # In a severe overload, also the queue, drained within a window: the requests queued on
    # an engine stay there (a Service does not move them), so the engines there need a
    # smaller share of what arrives to get through them while clients still wait.
    backlog = snapshot.requests_waiting / snapshot.window_s if ceiling is not None else 0.0
    per_pod = capacity or snapshot.requests_per_s / max(snapshot.pods, 1)
    most = (
        max(replicas, ceiling) if ceiling is not None else (config.max_scale_up_factor * replicas)
    )
    if per_pod <= 0:  # nothing served: no rate to size by, so one step at a time
        wanted = replicas + 1
    else:
        wanted = min(most, (demand + backlog) / (per_pod * config.scale_up_utilization))
    if math.ceil(wanted) <= replicas and snapshot.queue_growth_per_s <= 0:
        return None  # the engines there can serve the demand: the backlog is draining
    new = min(max(math.ceil(wanted), replicas + 1), most)
    return Proposal(
        REPLICAS,
        new,
        f"{why}; demand {demand:.3g} req/s"
        + (f" and {snapshot.requests_waiting:.3g} queued" if backlog else "")
        + f", {per_pod:.3g} req/s served per engine",
    )


def _overload_reason(snapshot: Snapshot, limits: Limits) -> str:
    parts = []
    if snapshot.ttft_p95_s is not None and snapshot.ttft_p95_s > limits.ttft_target_s:
        parts.append(
            f"TTFT p95 {snapshot.ttft_p95_s:.3g}s over the {limits.ttft_target_s:g}s target"
        )
    if snapshot.requests_waiting > 0:
        parts.append(f"{snapshot.requests_waiting:.3g} requests waiting")
    return " and ".join(parts) or "overloaded"


def _allowed(
    proposal: Proposal,
    settings: dict[str, float],
    limits: Limits,
    state: dict[str, Any],
    now: float,
    config: PolicyConfig,
) -> Proposal | str:
    """The proposal held to the bounds, or why the bounds, a pin, a dwell or an earlier
    revert leave nothing of it."""
    knob = proposal.knob
    if knob not in limits.bounds:
        return f"{knob} is fixed: {limits.fixed.get(knob, 'not tunable')}"
    low, high = limits.bounds[knob]
    if knob == MAX_NUM_SEQS and limits.max_num_batched_tokens is not None:
        high = min(high, limits.max_num_batched_tokens)
    current = settings[knob]
    new = min(max(proposal.new, low), high)
    if knob != GPU_MEMORY_UTILIZATION:
        new = int(round(new))
    way = direction(current, new)
    # Clamping may bring a value from outside the bounds back inside, but only in the
    # direction the rule asked for: a scale-up never turns into a scale-down.
    if way == 0 or way != direction(current, proposal.new):
        return f"{knob} {fmt(current)} is at its bound [{fmt(low)}, {fmt(high)}]"
    last = state["lastMove"].get(knob)
    dwell = config.reversal_dwell_cooldowns * limits.cooldown_s
    if last is not None and last["direction"] == -way and now - last["time"] < dwell:
        return f"{knob} moved the other way {now - last['time']:.0f}s ago"
    for rejected in state["rejected"]:
        if rejected["knob"] == knob and rejected["direction"] == way:
            if (new - rejected["value"]) * way >= 0:
                return f"{knob} {fmt(rejected['value'])} was reverted recently"
    return dataclasses.replace(proposal, new=new)


def _steady_reason(snapshot: Snapshot, limits: Limits) -> str:
    ttft = "n/a" if snapshot.ttft_p95_s is None else f"{snapshot.ttft_p95_s:.3g}s"
    return (
        f"steady: TTFT p95 {ttft} (target {limits.ttft_target_s:g}s), "
        f"{snapshot.requests_waiting:.3g} waiting, KV cache {snapshot.kv_cache_usage:.0%}"
    )


# ----- helpers --------------------------------------------------------------------------


def _normalized(state: dict[str, Any] | None) -> dict[str, Any]:
    normalized = empty_state()
    for key, value in copy.deepcopy(state or {}).items():
        if key in normalized and value is not None:
            normalized[key] = value
    normalized["streaks"] = {**empty_state()["streaks"], **normalized["streaks"]}
    return normalized


def _halved(value: float, config: PolicyConfig) -> int:
    return max(1, min(int(value) - 1, math.ceil(value / config.max_num_seqs_factor)))
