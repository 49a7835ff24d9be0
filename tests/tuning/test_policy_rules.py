"""Every rule of the tuner's policy, its bounds, cooldown, hysteresis and revert."""

from __future__ import annotations

import dataclasses

from pagoda_operator.tuning.policy import (
    GPU_MEMORY_UTILIZATION,
    MAX_NUM_SEQS,
    REPLICAS,
    decide,
)
from pagoda_operator.tuning.state import TunerState

from .policy_cases import (
    COOLDOWN_S,
    IDLE,
    KV_BOUND,
    OOM,
    PREEMPTING,
    QUEUED_STEADY,
    QUEUED_WITH_FREE_KV,
    QUEUED_WITH_FULL_KV,
    Run,
    limits,
    settings,
    window,
)


def test_no_metrics_holds_everything_and_says_why() -> None:
    run = Run(settings(), limits())
    decision = run.step(None)
    assert decision.action == "hold"
    assert "Prometheus unreachable" in decision.reason
    # Missing windows do not count towards (or against) any streak.
    assert run.state is not None and set(run.state["streaks"].values()) == {0}


def test_healthy_load_holds() -> None:
    run = Run(settings(), limits())
    for _ in range(10):
        assert run.step(window()).action == "hold"
    assert run.decisions[-1].reason.startswith("steady")


def test_queue_with_kv_headroom_raises_max_num_seqs_after_hysteresis() -> None:
    run = Run(settings(seqs=64), limits())
    assert run.step(QUEUED_WITH_FREE_KV).action == "hold"  # one window is not a trend
    decision = run.step(QUEUED_WITH_FREE_KV)
    assert (decision.action, decision.knob, decision.old, decision.new) == (
        "change", MAX_NUM_SEQS, 64, 128,
    )  # fmt: skip
    assert "every batch slot busy" in decision.reason


def test_a_bigger_batch_waits_while_its_rollout_would_deepen_the_overload() -> None:
    # A queue that is not draining on 2 engines: restarting them one at a time for a bigger
    # batch would leave one engine with all of it, so engines are added first...
    decision = Run(settings(replicas=2, seqs=64), limits()).until_change(QUEUED_STEADY)
    assert (decision.knob, decision.old, decision.new) == (REPLICAS, 2, 3)
    # ...unless replicas cannot grow: then the bigger batch is the only lever left.
    bounds = {k: v for k, v in limits().bounds.items() if k != REPLICAS}
    pinned = limits(bounds=bounds, fixed={REPLICAS: "pinned in spec.tuning.pinned"})
    decision = Run(settings(replicas=2, seqs=64), pinned).until_change(QUEUED_STEADY)
    assert (decision.knob, decision.old, decision.new) == (MAX_NUM_SEQS, 64, 128)


def test_a_rollout_that_surges_without_unavailable_engines_raises_the_batch_at_once() -> None:
    # The same queue that is not draining: with maxSurge 1 and maxUnavailable 0 each new
    # engine starts before an old one stops, so the bigger batch costs no serving capacity.
    surging = limits(rollout_unavailable=0)
    decision = Run(settings(replicas=2, seqs=64), surging).until_change(QUEUED_STEADY)
    assert (decision.knob, decision.old, decision.new) == (MAX_NUM_SEQS, 64, 128)
    # Every other rule still holds it: a full cache adds engines instead...
    decision = Run(settings(replicas=2, seqs=64), surging).until_change(QUEUED_WITH_FULL_KV)
    assert decision.knob == REPLICAS
    # ...and the bound caps it.
    capped = limits(rollout_unavailable=0, bounds={**limits().bounds, MAX_NUM_SEQS: (8, 64)})
    decision = Run(settings(replicas=2, seqs=64), capped).until_change(QUEUED_STEADY)
    assert decision.knob == REPLICAS
    # In a severe overload engines come first all the same: the rollout and the window that
    # judges it hold every other change for minutes, each a window over the SLO.
    severe = dataclasses.replace(QUEUED_STEADY, ttft_p95_s=20.0, queue_growth_per_s=5.0)
    decision = Run(settings(replicas=2, seqs=64), surging).until_change(severe)
    assert decision.knob == REPLICAS


def test_a_bigger_batch_counts_the_engines_its_rollout_takes_away() -> None:
    # Three engines serving 10 req/s each; the queue shrinks by 10 req/s, so the demand is
    # 20 req/s: two engines carry it while one restarts (maxUnavailable 1)...
    draining = window(pods=3, requests_waiting=60.0, requests_running=192.0, ttft_p95_s=2.5,
                      requests_per_s=30.0, queue_growth_per_s=-10.0)  # fmt: skip
    one_down = Run(settings(replicas=3, seqs=64), limits()).until_change(draining)
    assert (one_down.knob, one_down.new) == (MAX_NUM_SEQS, 128)
    # ...one does not while two restart (maxUnavailable 2), nor none while all do (Recreate):
    # the batch stays (the queue drains on the engines there).
    for unavailable in (2, None):
        run = Run(settings(replicas=3, seqs=64), limits(rollout_unavailable=unavailable))
        assert all(run.step(draining).action == "hold" for _ in range(6))


# Calm: nothing waiting, TTFT at 10 % of the target, 25 sequences an engine in 64 slots and
# the cache 6 % full: 128 sequences an engine would fill 31 % of it.
CALM_ROOMY = window(requests_running=50.0, kv_cache_usage=0.06, ttft_p95_s=0.1)


def test_a_calm_window_raises_max_num_seqs_ahead_of_the_load_when_the_cache_holds_more() -> None:
    # With maxSurge 1 and maxUnavailable 0 the rollout takes no engine away: the bigger
    # batch is made now, while nothing waits, not in the peak that would fill 64 slots
    # (every engine restarting then costs the minutes of its rollout and its judgment).
    run = Run(settings(replicas=2, seqs=64), limits(rollout_unavailable=0))
    assert run.step(CALM_ROOMY).action == "hold"  # one window is not a trend
    decision = run.step(CALM_ROOMY)
    assert (decision.knob, decision.old, decision.new) == (MAX_NUM_SEQS, 64, 128)
    assert "128 sequences an engine fill 31% of it" in decision.reason
    # Not when the cache would not hold a quarter more sequences (25 an engine fill 30 %)...
    crowded = dataclasses.replace(CALM_ROOMY, kv_cache_usage=0.3)
    run = Run(settings(replicas=2, seqs=64), limits(rollout_unavailable=0))
    assert all(run.step(crowded).action == "hold" for _ in range(10))
    # ...nor when the ITL is not well within its target: a bigger batch slows every token.
    run = Run(settings(replicas=2, seqs=64), limits(rollout_unavailable=0, itl_target_s=0.015))
    assert all(run.step(CALM_ROOMY).action == "hold" for _ in range(10))


# The same calm load on the 3 engines of a covered rollout (2 and the one added).
CALM_COVERED = dataclasses.replace(CALM_ROOMY, pods=3, requests_running=50.0)


def test_a_calm_raise_that_takes_an_engine_away_first_adds_one_to_cover_its_rollout() -> None:
    # With maxUnavailable 1 one engine would serve the 20 req/s alone while the other
    # restarts, and no saturated rate says it can. So the engine the rollout takes down is
    # added first...
    run = Run(settings(replicas=2, seqs=64), limits())
    cover = run.until_change(CALM_ROOMY)
    assert (cover.knob, cover.old, cover.new) == (REPLICAS, 2, 3)
    assert "1 engines added to cover the rollout of maxNumSeqs 64 -> 128" in cover.reason
    # ...not a tuning move of replicas: no cooldown starts, and no dwell holds a scale-up.
    assert run.state is not None and run.state["lastChangeTime"] is None
    assert run.state["lastMove"] == {}
    # While it starts, nothing else moves.
    assert run.step(CALM_COVERED, rollout_complete=False).action == "hold"
    # Once it is Ready, the bigger batch rolls out: the Deployment at 3 with maxUnavailable
    # 1 keeps 2 engines ready throughout.
    change = run.step(CALM_COVERED)
    assert (change.knob, change.old, change.new) == (MAX_NUM_SEQS, 64, 128)
    assert "engines added to cover its rollout are Ready" in change.reason
    assert run.step(CALM_COVERED, rollout_complete=False).action == "hold"
    assert run.step(CALM_COVERED).action == "hold"  # its first full window follows
    # Judged and kept; in the same window the lent engine goes back.
    back = run.step(CALM_COVERED)
    assert (back.knob, back.old, back.new) == (REPLICAS, 3, 2)
    assert back.verdict is not None and back.verdict.startswith("kept maxNumSeqs 64 -> 128")
    assert "giving back the 1 engines added to cover" in back.reason
    assert run.state["cover"] is None and run.settings[MAX_NUM_SEQS] == 128


def test_a_covered_raise_is_made_only_with_room_for_the_cover_and_a_need_for_it() -> None:
    # At maxReplicas, and with Recreate (which stops every engine, however many there are),
    # no engine can cover the rollout: without a measured saturated rate the batch stays...
    at_max = limits(bounds={**limits().bounds, REPLICAS: (1, 2)})
    for bounded in (at_max, limits(rollout_unavailable=None)):
        run = Run(settings(replicas=2, seqs=64), bounded)
        assert all(run.step(CALM_ROOMY).action == "hold" for _ in range(10))
    # ...and so it does when one engine would run over 85 % of the rate measured...
    run = measured(Run(settings(replicas=2, seqs=64), at_max), 20.0)
    assert all(run.step(CALM_ROOMY).action == "hold" for _ in range(10))
    # ...but with 30 req/s an engine measured, one carries the 20 arriving; and then no
    # engine is lent where there is room either: a GPU is not spent for nothing.
    for bounded in (at_max, limits()):
        run = measured(Run(settings(replicas=2, seqs=64), bounded), 30.0)
        decision = run.until_change(CALM_ROOMY)
        assert (decision.knob, decision.old, decision.new) == (MAX_NUM_SEQS, 64, 128)


def test_engines_added_to_cover_a_change_stay_when_the_load_rises_meanwhile() -> None:
    run = Run(settings(replicas=2, seqs=64), limits())
    assert run.until_change(CALM_ROOMY).knob == REPLICAS
    # Ready, but TTFT rose near the target: the replica rules want the engine, it stays, and
    # the batch waits for the next calm.
    rising = dataclasses.replace(CALM_COVERED, ttft_p95_s=0.9)
    decision = run.step(rising)
    assert decision.action == "hold" and "they stay" in decision.reason
    assert run.settings[REPLICAS] == 3 and run.state is not None and run.state["cover"] is None
    # Likewise after the change is judged: a queue on the engines there keeps them.
    run = Run(settings(replicas=2, seqs=64), limits())
    run.until_change(CALM_ROOMY)
    assert run.step(CALM_COVERED).knob == MAX_NUM_SEQS
    assert run.step(CALM_COVERED).action == "hold"
    queued = dataclasses.replace(CALM_COVERED, requests_waiting=6.0, ttft_p95_s=0.3)
    decision = run.step(queued)
    assert decision.verdict is not None and decision.verdict.startswith("kept")
    assert run.settings[REPLICAS] == 3 and run.state is not None and run.state["cover"] is None


def test_engines_added_to_cover_a_change_that_never_come_up_are_reverted_with_it() -> None:
    run = Run(settings(replicas=2, seqs=64), limits(rollout_deadline_s=300.0))
    assert run.until_change(CALM_ROOMY).knob == REPLICAS
    decisions = [run.step(CALM_ROOMY, rollout_complete=False) for _ in range(7)]
    assert [d.action for d in decisions] == ["hold"] * 5 + ["revert", "hold"]
    assert (decisions[5].knob, decisions[5].new) == (REPLICAS, 2)
    assert "rollout not complete" in decisions[5].reason
    assert run.settings == settings(replicas=2, seqs=64)  # the batch was never changed
    assert run.state is not None and run.state["cover"] is None


def test_a_covered_change_is_judged_per_engine() -> None:
    # Before: 2 engines process 5,000 tokens/s. After, on 3 engines with requests waiting,
    # 4,500 in all: 90 % of the total, but 1,500 an engine against 2,500 (60 %). The engine
    # lent for the rollout must not pass for what the new value serves: reverted.
    run = Run(settings(replicas=2, seqs=64), limits())
    run.until_change(CALM_ROOMY)
    assert run.step(CALM_COVERED).knob == MAX_NUM_SEQS
    assert run.step(CALM_COVERED).action == "hold"
    slower = dataclasses.replace(
        CALM_COVERED, requests_waiting=30.0, generation_tokens_per_s=4500.0, ttft_p95_s=0.4
    )
    decision = run.step(slower)
    assert (decision.action, decision.knob, decision.new) == ("revert", MAX_NUM_SEQS, 64)
    assert "tokens processed" in decision.reason


def test_a_cache_filling_inside_the_cooldown_adds_engines_once_the_last_change_is_judged() -> None:
    # One engine added for a TTFT close to its target, rolled out and kept...
    run = Run(settings(replicas=2), limits())
    assert run.until_change(window(ttft_p95_s=0.85)).new == 3
    changed_at = run.now
    assert run.step(window(pods=3)).action == "hold"  # the first full window after it
    kept = run.step(window(pods=3))
    assert kept.verdict is not None and kept.verdict.startswith("kept replicas 2 -> 3")
    # ...then, inside its cooldown, the cache fills fast (30 % -> 88 %). Engines are added
    # now, not when the cooldown ends: they add capacity, nothing can flap, and the rule's
    # own hysteresis is all the steadiness it needs (a calm window's engine-knob change
    # made ahead of the load must not hold back the engines that load needs).
    decision = run.step(window(pods=3, kv_cache_usage=0.88, requests_running=600.0))
    assert (decision.action, decision.knob, decision.old, decision.new) == (
        "change", REPLICAS, 3, 4,
    )  # fmt: skip
    assert run.now - changed_at < COOLDOWN_S


def test_queue_without_kv_headroom_adds_replicas_instead() -> None:
    run = Run(settings(replicas=2, seqs=64), limits())
    decision = run.until_change(QUEUED_WITH_FULL_KV)
    assert decision.knob == REPLICAS
    # 140 requests in flight at 80% of 64 slots each want 3 replicas.
    assert (decision.old, decision.new) == (2, 3)


# A backlog far longer than the batch, draining at 15 req/s on 4 engines that serve 10 req/s
# each: 3 engines carry the 25 req/s arriving while the 4th restarts.
DRAINING = window(pods=4, requests_waiting=400.0, requests_running=256.0, ttft_p95_s=4.0,
                  requests_per_s=40.0, queue_growth_per_s=-15.0)  # fmt: skip


def test_full_slots_with_a_long_queue_raise_max_num_seqs_before_adding_engines() -> None:
    # 64 slots busy on each engine, the cache 30 % full: 128 sequences an engine fill 60 %
    # of it, so the bigger batch fits.
    decision = Run(settings(replicas=4, seqs=64), limits()).until_change(DRAINING)
    assert (decision.knob, decision.old, decision.new) == (MAX_NUM_SEQS, 64, 128)
    assert "KV cache at 30%: 128 sequences fill 60%" in decision.reason


def test_full_slots_raise_max_num_seqs_only_as_far_as_the_cache_holds() -> None:
    # 64 sequences an engine fill 50 % of the cache: 96 fill 75 % of it, not 128.
    half = dataclasses.replace(DRAINING, kv_cache_usage=0.5)
    decision = Run(settings(replicas=4, seqs=64), limits()).until_change(half)
    assert (decision.knob, decision.new) == (MAX_NUM_SEQS, 96)
    # At 65 % only 73 would fit: too few to be worth restarting every engine.
    run = Run(settings(replicas=4, seqs=64), limits())
    tight = dataclasses.replace(DRAINING, kv_cache_usage=0.65)
    assert all(run.step(tight).knob != MAX_NUM_SEQS for _ in range(10))


def test_scale_up_follows_demand_at_most_tripling_and_stays_under_max() -> None:
    # 10 req/s served per engine, the queue growing by 40 req/s: 60 req/s at 85 % of the
    # rate served want 8 engines; TTFT 2.5 s is over target but not far over it.
    growing = window(requests_waiting=2000.0, requests_running=100.0, kv_cache_usage=0.8,
                     ttft_p95_s=2.5, queue_growth_per_s=40.0)  # fmt: skip
    decision = Run(settings(replicas=2), limits()).until_change(growing)
    assert (decision.knob, decision.new) == (REPLICAS, 6)  # at most three times as many
    assert "demand 60 req/s, 10 req/s served per engine" in decision.reason
    decision = Run(settings(replicas=1), limits()).until_change(growing)
    assert (decision.knob, decision.new) == (REPLICAS, 3)
    decision = Run(settings(replicas=6), limits()).until_change(growing)
    assert (decision.knob, decision.new) == (REPLICAS, 8)  # held to the maximum
    capped = limits(bounds={**limits().bounds, REPLICAS: (1, 6)})
    run = Run(settings(replicas=6), capped)
    assert all(run.step(growing).knob != REPLICAS for _ in range(10))
    assert "replicas 6 is at its bound [1, 6]" in run.decisions[-1].reason


def test_clients_giving_up_get_the_engines_the_demand_needs_at_once() -> None:
    # The same 60 req/s, 40 of them given up on, and 600 requests queued on the engines
    # there: every window short is one more the SLO misses, so at once the engines for the
    # 60 req/s arriving and for the queue to drain within a window (10 req/s more): 70 at
    # 85 % of 10 req/s an engine want 9, not 6 and then more a cooldown later...
    flood = window(requests_waiting=600.0, requests_running=100.0, kv_cache_usage=0.8,
                   ttft_p95_s=30.0, aborted_per_s=40.0)  # fmt: skip
    wide = limits(bounds={**limits().bounds, REPLICAS: (1, 12)})
    decision = Run(settings(replicas=2), wide).step(flood)
    assert (decision.knob, decision.new) == (REPLICAS, 9)
    assert "demand 60 req/s and 600 queued" in decision.reason
    # ...and still no more than the bound.
    capped = limits(bounds={**wide.bounds, REPLICAS: (1, 5)})
    assert Run(settings(replicas=2), capped).step(flood).new == 5


def test_clients_giving_up_skip_the_hysteresis() -> None:
    giving_up = dataclasses.replace(QUEUED_WITH_FULL_KV, aborted_per_s=5.0)
    assert Run(settings(), limits()).step(giving_up).knob == REPLICAS


def queued_since_last_window() -> dict:
    """State after one window with a queue: the next window with one is saturated."""
    return {"streaks": {"queued": 1}}


def test_demand_near_the_measured_rate_scales_up_before_a_queue_forms() -> None:
    run = Run(settings(replicas=2), limits(), state=queued_since_last_window())
    run.step(QUEUED_WITH_FULL_KV)  # saturated: 10 req/s per engine is what one serves
    assert run.state is not None and run.state["capacity"]["requestsPerPod"] == 10
    no_queue_yet = window(requests_per_s=19.0, ttft_p95_s=0.3)
    decision = run.until_change(no_queue_yet)
    assert (decision.knob, decision.new) == (REPLICAS, 3)
    assert "95% of the engines' saturated rate" in decision.reason


def test_a_queue_that_drains_within_a_window_is_no_saturated_rate() -> None:
    # 2 x 20 req/s with a short queue in one window, none in the next: a Poisson burst at
    # high load that the engines absorbed, not what they can serve at most.
    run = Run(settings(replicas=2), limits())
    run.step(dataclasses.replace(QUEUED_WITH_FULL_KV, ttft_p95_s=0.3, requests_per_s=40.0))
    assert run.state is not None and run.state["capacity"] is None
    # So demand near that rate is no reason to add a replica.
    near = window(requests_per_s=42.0, ttft_p95_s=0.3)
    assert all(run.step(near).action == "hold" for _ in range(6))
    assert run.state["capacity"] is None


def test_a_queue_that_lasts_or_hurts_gives_the_saturated_rate() -> None:
    queued = dataclasses.replace(QUEUED_WITH_FULL_KV, queue_growth_per_s=0.5)
    run = Run(settings(replicas=2), limits())
    run.step(queued)
    assert run.state is not None and run.state["capacity"] is None
    run.step(queued)  # a second window in a row: saturated
    assert run.state["capacity"]["requestsPerPod"] == 10
    # One window is enough when clients give up or TTFT is far over target.
    for severe in ({"aborted_per_s": 5.0}, {"ttft_p95_s": 6.0}):
        run = Run(settings(replicas=2), limits())
        run.step(dataclasses.replace(queued, **severe))
        assert run.state is not None and run.state["capacity"]["requestsPerPod"] == 10
    # A backlog draining is no measure: what finishes was admitted windows earlier.
    draining = dataclasses.replace(queued, queue_growth_per_s=-0.5, requests_per_s=60.0)
    run = Run(settings(replicas=2), limits(), state=queued_since_last_window())
    run.step(draining)
    assert run.state is not None and run.state["capacity"] is None


def measured(run: Run, requests_per_pod: float) -> Run:
    """``run`` with a saturated rate measured one window ago (for requests like IDLE's)."""
    run.state = {"capacity": {"requestsPerPod": requests_per_pod,
                              "promptTokensPerRequest": 0.0, "time": run.now}}  # fmt: skip
    return run


def test_the_window_that_judges_a_change_gives_the_saturated_rate() -> None:
    # Idle on 2 engines, so one goes; on the one left a queue builds for two windows.
    run = measured(Run(settings(replicas=2), limits()), 8.0)
    assert run.until_change(IDLE).new == 1
    one_engine = dataclasses.replace(
        QUEUED_WITH_FULL_KV, pods=1, requests_per_s=10.0, queue_growth_per_s=1.0
    )
    assert run.step(one_engine).action == "hold"  # rolled out; its full window follows
    assert run.state is not None and run.state["capacity"]["requestsPerPod"] == 8
    decision = run.step(one_engine)  # the window that judges it: saturated, and reverted
    assert decision.action == "revert"
    assert run.state["capacity"]["requestsPerPod"] == 10


def test_scale_down_by_measured_rate_keeps_what_the_load_needs() -> None:
    run = Run(settings(replicas=3), limits(), state=queued_since_last_window())
    run.step(dataclasses.replace(QUEUED_WITH_FULL_KV, pods=3, requests_per_s=30.0))
    # 10 req/s per engine when saturated; 14 req/s on 2 engines would be 70 %: stay.
    quiet = window(pods=3, requests_running=10.0, ttft_p95_s=0.1, requests_per_s=14.0)
    assert all(run.step(quiet).knob is None for _ in range(8))
    # 10 req/s on 2 engines is 50 %: one goes.
    quieter = dataclasses.replace(quiet, requests_per_s=10.0)
    decision = run.until_change(quieter)
    assert (decision.knob, decision.new) == (REPLICAS, 2)
    assert "would run at 50% of their saturated rate" in decision.reason


def measured_slot_bound(
    run: Run, seqs: int, kv_cache_usage: float = 0.2, itl_s: float | None = 0.012
) -> Run:
    """``run`` with a saturated rate of 10 req/s an engine measured at ``maxNumSeqs``
    ``seqs``, every engine running 62 of its 64 slots (the slots were the limit)."""
    run.state = {"capacity": {
        "requestsPerPod": 10.0, "promptTokensPerRequest": 0.0, "time": run.now,
        "maxNumSeqs": seqs, "requestsRunningPerPod": 62.0, "itlP95Seconds": itl_s,
        "kvCacheUsage": kv_cache_usage,
    }}  # fmt: skip
    return run


# 3 engines at 14 req/s, 10 sequences each, the decode step 8 ms: on 2 engines, 7 req/s each.
QUIET_ON_3 = window(pods=3, requests_running=30.0, ttft_p95_s=0.1, requests_per_s=14.0,
                    itl_p95_s=0.008, kv_cache_usage=0.1)  # fmt: skip
LIVE_TO_128 = limits(bounds={**limits().bounds, MAX_NUM_SEQS: (8, 128)}, engine_knobs_live=True)


def test_the_saturated_rate_follows_a_raise_of_slot_bound_engines() -> None:
    # Measured at 64 slots, 62 of them busy, a 12 ms step; then maxNumSeqs went to 128
    # (a kept live raise). This window's 10 sequences at 8 ms fit the step: 7.2 ms +
    # 77 us a sequence, so 124 sequences take 16.8 ms a step, and an engine serves 43 %
    # more: 14.3 req/s, not twice the 10 (the step grows with the batch) nor the 10.
    run = measured_slot_bound(Run(settings(replicas=3, seqs=128), LIVE_TO_128), seqs=64)
    decision = run.until_change(QUIET_ON_3)
    # 7 req/s an engine on 2 is 49 % of 14.3: one goes (70 % of the 10 measured would not).
    assert (decision.knob, decision.old, decision.new) == (REPLICAS, 3, 2)
    assert "would run at 49% of their saturated rate" in decision.reason
    # At 64, as measured, the same window keeps all three.
    run = measured_slot_bound(Run(settings(replicas=3, seqs=64), LIVE_TO_128), seqs=64)
    assert all(run.step(QUIET_ON_3).action == "hold" for _ in range(10))


def test_the_saturated_rate_of_an_engine_the_cache_limited_does_not_follow_a_raise() -> None:
    # The same, but the cache was half full at 62 sequences: 124 would fill it, so the
    # cache, not the slots, is the limit and the rate measured stands (70 %: all stay).
    run = measured_slot_bound(
        Run(settings(replicas=3, seqs=128), LIVE_TO_128), seqs=64, kv_cache_usage=0.5
    )
    assert all(run.step(QUIET_ON_3).action == "hold" for _ in range(10))
    # And without a second point to fit the step (no ITL measured then), it stands too.
    run = measured_slot_bound(Run(settings(replicas=3, seqs=128), LIVE_TO_128), seqs=64, itl_s=None)
    assert all(run.step(QUIET_ON_3).action == "hold" for _ in range(10))


def test_the_saturated_rate_falls_with_a_cut_of_slot_bound_engines() -> None:
    # Measured at 64 slots, now 48: at least 48/64 of it, 7.5 req/s an engine; 3 engines
    # at 17 req/s (on 2: 8.5 each, 85 % of 10) stay, as they would at 64 anyway, and near
    # the 7.5 the engines are busy: one more comes before a queue forms.
    run = measured_slot_bound(Run(settings(replicas=3, seqs=48), limits()), seqs=64)
    near = dataclasses.replace(QUIET_ON_3, requests_per_s=21.0)  # 7 req/s an engine: 93 %
    decision = run.until_change(near)
    assert (decision.knob, decision.new) == (REPLICAS, 4)
    assert "93% of the engines' saturated rate" in decision.reason


def test_a_saturated_window_at_the_new_max_num_seqs_replaces_the_estimate() -> None:
    run = measured_slot_bound(Run(settings(replicas=2, seqs=128), LIVE_TO_128), seqs=64)
    run.state = {**(run.state or {}), "streaks": {"queued": 1}}
    # Saturated at 128: 11 req/s an engine, measured; the 14 the raise was estimated at
    # (by this window's step) is not kept as the best seen.
    run.step(dataclasses.replace(QUEUED_WITH_FULL_KV, requests_per_s=22.0,
                                 queue_growth_per_s=0.5))  # fmt: skip
    assert run.state is not None
    capacity = run.state["capacity"]
    assert (capacity["requestsPerPod"], capacity["maxNumSeqs"]) == (11.0, 128)
    assert capacity["requestsRunningPerPod"] == 50.0 and capacity["kvCacheUsage"] == 0.8


def test_idle_removes_one_replica_after_a_longer_streak() -> None:
    run = measured(Run(settings(replicas=3), limits()), 10.0)
    for _ in range(3):
        assert run.step(IDLE).action == "hold"
    decision = run.step(IDLE)
    assert (decision.knob, decision.old, decision.new) == (REPLICAS, 3, 2)


def test_idle_never_goes_below_min_replicas() -> None:
    floor = limits(bounds={**limits().bounds, REPLICAS: (2, 8)})
    run = Run(settings(replicas=2), floor)
    assert all(run.step(IDLE).action == "hold" for _ in range(20))


def test_idle_keeps_replicas_the_load_still_needs() -> None:
    # 100 in flight would put 100 on one replica of 64 slots: not idle enough to remove one.
    busy_but_fast = window(requests_running=100.0, ttft_p95_s=0.1)
    run = Run(settings(replicas=2, seqs=64), limits())
    for _ in range(20):
        run.step(busy_but_fast)
        assert run.settings[REPLICAS] >= 2  # (the calm window may lend one for a bigger batch)


def test_sustained_preemptions_fit_max_num_seqs_to_the_cache() -> None:
    run = Run(settings(seqs=256), limits())
    sustained = dataclasses.replace(PREEMPTING, preemptions_per_s=0.4)  # no storm
    assert [run.step(sustained).action for _ in range(2)] == ["hold", "hold"]
    decision = run.step(sustained)
    # 60 sequences an engine filled 97 % of the cache: 46 fill 75 % of it.
    assert (decision.knob, decision.old, decision.new) == (MAX_NUM_SEQS, 256, 46)
    assert "preemptions/s" in decision.reason and "outgrows the KV cache" in decision.reason


def test_preemptions_lower_max_num_seqs_only_to_what_the_cache_holds() -> None:
    # 130 sequences an engine filled 97 % of the cache: 100 fill 75 % of it, no fewer.
    nearly_fits = dataclasses.replace(PREEMPTING, requests_running=260.0, preemptions_per_s=0.4)
    decision = Run(settings(seqs=128), limits()).until_change(nearly_fits)
    assert (decision.knob, decision.new) == (MAX_NUM_SEQS, 100)


def test_a_preemption_storm_acts_in_its_first_window() -> None:
    storm = dataclasses.replace(PREEMPTING, preemptions_per_s=20.0)
    decision = Run(settings(seqs=256), limits()).step(storm)
    assert (decision.action, decision.knob, decision.new) == ("change", MAX_NUM_SEQS, 46)


def test_preemptions_lower_max_num_seqs_before_raising_gpu_memory() -> None:
    decision = Run(settings(seqs=128, memory=0.9), limits()).until_change(PREEMPTING)
    assert decision.knob == MAX_NUM_SEQS


def test_a_cache_filling_up_adds_engines_before_it_is_full() -> None:
    # Long-lived sequences: no queue, TTFT fine, the cache 88 % full on 2 engines.
    filling = window(kv_cache_usage=0.88, requests_running=400.0)
    run = Run(settings(replicas=2), limits())
    assert run.step(filling).action == "hold"  # one window is not a trend
    decision = run.step(filling)
    assert (decision.knob, decision.old, decision.new) == (REPLICAS, 2, 3)  # 59 % on 3
    assert "KV cache 88% full" in decision.reason and "for 2 windows" in decision.reason


def test_a_cache_filling_fast_adds_engines_in_one_window() -> None:
    run = Run(settings(replicas=2), limits())
    assert run.step(window(kv_cache_usage=0.6, requests_running=300.0)).action == "hold"
    # 60 % -> 80 %: at this pace 100 % by the next window.
    decision = run.step(window(kv_cache_usage=0.8, requests_running=400.0))
    assert (decision.action, decision.knob, decision.new) == ("change", REPLICAS, 3)
    assert "next window at this pace: 100%" in decision.reason


def test_no_scale_down_that_would_fill_the_cache() -> None:
    # Idle by requests/s (a rate is measured), but the cache is 40 % full on 3 engines:
    # on 2 it would be 60 %... and on 2 at 55 % it would be 82 %: that one stays.
    full = dataclasses.replace(IDLE, pods=3, kv_cache_usage=0.55)
    run = measured(Run(settings(replicas=3), limits()), 10.0)
    assert all(run.step(full).action == "hold" for _ in range(10))
    roomy = dataclasses.replace(full, kv_cache_usage=0.4)
    assert run.until_change(roomy).new == 2


def test_ttft_close_to_the_target_adds_one_engine() -> None:
    close = window(ttft_p95_s=0.85)  # 85 % of the 1 s target, nothing else wrong
    run = Run(settings(replicas=2), limits())
    assert run.step(close).action == "hold"
    decision = run.step(close)
    assert (decision.knob, decision.old, decision.new) == (REPLICAS, 2, 3)
    assert "85% of the 1s target" in decision.reason
    assert all(run.step(window(ttft_p95_s=0.7)).action == "hold" for _ in range(20))


def test_no_scale_down_without_a_measured_saturated_rate() -> None:
    # One request in flight per 128 slots, for an hour: without a rate measured at
    # saturation, removing a replica would be a guess that can break the SLO.
    run = Run(settings(replicas=3, seqs=128), limits())
    assert all(run.step(IDLE).action == "hold" for _ in range(60))


def test_severe_overload_after_a_kept_scale_up_acts_before_the_cooldown_ends() -> None:
    run = Run(settings(replicas=2), limits(bounds={**limits().bounds, REPLICAS: (1, 16)}))
    flood = window(requests_waiting=400.0, requests_running=100.0, kv_cache_usage=0.8,
                   ttft_p95_s=20.0, aborted_per_s=40.0)  # fmt: skip
    assert (run.until_change(flood).knob, run.settings[REPLICAS]) == (REPLICAS, 8)
    assert run.step(flood).action == "hold"  # the window of the rollout
    # Judged and kept, and still clients give up, more of them than before.
    decision = run.step(dataclasses.replace(flood, aborted_per_s=80.0))
    assert decision.verdict is not None and decision.verdict.startswith("kept replicas 2 -> 8")
    assert (decision.action, decision.knob) == ("change", REPLICAS)
    assert run.settings[REPLICAS] > 8


def test_inside_the_cooldown_only_changes_that_add_capacity_are_made() -> None:
    run = Run(settings(replicas=2, seqs=64), limits())
    # Severe, with every slot busy and the cache nearly empty: clients give up on 40 req/s,
    # so engines come first, and inside the cooldown only changes that add them are made.
    severe = dataclasses.replace(QUEUED_WITH_FREE_KV, ttft_p95_s=20.0, requests_waiting=100.0,
                                 requests_running=128.0, aborted_per_s=40.0,
                                 queue_growth_per_s=0.0)  # fmt: skip
    first = run.until_change(severe)
    assert (first.knob, first.new) == (REPLICAS, 8)  # the maximum: none can be added now
    run.step(window())  # the rollout, then a calm window that keeps it
    run.step(window())
    # Still severe: with replicas at their bound the bigger batch is the lever left, but
    # it restarts engines, so it waits for the cooldown to end.
    later = [run.step(severe) for _ in range(2)]
    assert all(d.action == "hold" and d.reason.startswith("cooldown") for d in later), later
    after = run.step(severe)
    assert (after.knob, after.old, after.new) == (MAX_NUM_SEQS, 64, 128)
    assert all(d.action == "hold" for d in [run.step(IDLE) for _ in range(3)])  # no cut


def test_kv_bound_raises_gpu_memory_utilization_by_one_step() -> None:
    decision = Run(settings(memory=0.9), limits()).until_change(KV_BOUND)
    assert decision.knob == GPU_MEMORY_UTILIZATION
    assert decision.new == 0.92


def test_gpu_memory_is_not_raised_without_an_oom_signal() -> None:
    # No kube-state-metrics: an OOM would go unseen, so the risky knob stays where it is.
    decision = Run(settings(), limits()).until_change(dataclasses.replace(KV_BOUND, oom_kills=None))
    assert decision.knob != GPU_MEMORY_UTILIZATION


def test_oom_kill_lowers_gpu_memory_at_once() -> None:
    decision = Run(settings(memory=0.9), limits()).step(OOM)
    assert (decision.action, decision.knob, decision.new) == (
        "change", GPU_MEMORY_UTILIZATION, 0.88,
    )  # fmt: skip
    assert "OOM" in decision.reason


def test_oom_at_the_memory_floor_lowers_max_num_seqs() -> None:
    decision = Run(settings(memory=0.8, seqs=64), limits()).step(OOM)
    assert (decision.knob, decision.new) == (MAX_NUM_SEQS, 32)


def test_after_an_oom_gpu_memory_is_not_raised_again_soon() -> None:
    run = Run(settings(memory=0.9), limits())
    assert run.step(OOM).knob == GPU_MEMORY_UTILIZATION
    run.wait_cooldown(window())
    for _ in range(8):
        decision = run.step(KV_BOUND)
        assert decision.knob != GPU_MEMORY_UTILIZATION, decision


def test_cooldown_holds_after_a_change() -> None:
    run = Run(settings(seqs=64), limits())
    run.until_change(QUEUED_WITH_FREE_KV)
    holds = [run.step(QUEUED_WITH_FREE_KV) for _ in range(int(COOLDOWN_S // 60) - 1)]
    assert all(d.action == "hold" for d in holds)
    assert any(d.reason.startswith("cooldown") for d in holds)
    assert run.step(QUEUED_STEADY).action == "change"


def test_change_is_watched_only_after_the_rollout() -> None:
    run = Run(settings(seqs=64), limits())
    run.until_change(QUEUED_WITH_FREE_KV)
    for _ in range(10):
        decision = run.step(window(), rollout_complete=False)
        assert decision.reason.startswith("waiting for the rollout")
    # Rolled out: the first window after it only starts the watch; the next one judges.
    assert run.step(window()).reason.startswith("watching the first full window")
    decision = run.step(window())
    assert decision.verdict is not None and decision.verdict.startswith("kept maxNumSeqs 64 -> 128")


def test_a_rollout_past_its_deadline_is_reverted_and_its_value_banned() -> None:
    run = Run(settings(seqs=64), limits(rollout_deadline_s=300))
    run.until_change(QUEUED_WITH_FREE_KV)  # 64 -> 128, never rolled out (no GPU free, say)
    decisions = [run.step(QUEUED_WITH_FREE_KV, rollout_complete=False) for _ in range(6)]
    assert [d.action for d in decisions] == ["hold"] * 5 + ["revert"]
    revert = decisions[-1]
    assert (revert.knob, revert.old, revert.new) == (MAX_NUM_SEQS, 128, 64)
    assert "rollout not complete 360s after the change (deadline 300s)" in revert.reason
    assert run.state["rejected"][0]["value"] == 128
    run.wait_cooldown(QUEUED_WITH_FREE_KV)
    assert run.until_change(QUEUED_STEADY).knob == REPLICAS  # not 128 again


def test_engines_restarting_while_a_change_rolls_out_revert_it_at_once() -> None:
    """A CUDA out-of-memory error at start-up is a process exit: restarts, no OOM kill."""
    run = Run(settings(seqs=64), limits())
    run.until_change(QUEUED_WITH_FREE_KV)
    decision = run.step(window(restarts=3.0, oom_kills=0.0), rollout_complete=False)
    assert (decision.action, decision.new) == ("revert", 64)
    assert "3 engine restarts while it rolled out" in decision.reason


def test_restarts_after_a_raised_engine_knob_revert_it() -> None:
    run = Run(settings(seqs=64), limits())
    run.until_change(QUEUED_WITH_FREE_KV)
    run.step(window())
    decision = run.step(window(restarts=1.0, oom_kills=0.0))
    assert (decision.action, decision.new) == ("revert", 64)
    assert "1 engine restarts after raising it" in decision.reason


def test_the_rollout_deadline_runs_while_no_engine_reports_metrics() -> None:
    run = Run(settings(seqs=64), limits(rollout_deadline_s=300))
    run.until_change(QUEUED_WITH_FREE_KV)
    decisions = [run.step(None, rollout_complete=False) for _ in range(6)]
    assert [d.action for d in decisions] == ["hold"] * 5 + ["revert"]
    assert decisions[0].reason.startswith("holding steady: Prometheus unreachable")


def test_raise_that_cost_throughput_is_reverted_and_not_retried() -> None:
    run = Run(settings(seqs=64), limits())
    run.until_change(QUEUED_WITH_FREE_KV)  # 64 -> 128 at 5000 tok/s
    run.step(window())
    slower = dataclasses.replace(QUEUED_WITH_FREE_KV, generation_tokens_per_s=2000.0)
    decision = run.step(slower)
    assert (decision.action, decision.knob, decision.old, decision.new) == (
        "revert", MAX_NUM_SEQS, 128, 64,
    )  # fmt: skip
    assert "tokens processed (prompt + generated) 5000 -> 2000/s, generated 5000 -> 2000/s" in (
        decision.reason)
    assert run.settings[MAX_NUM_SEQS] == 64
    # The same queue again: 128 was tried and failed, so the tuner adds a replica instead.
    run.wait_cooldown(QUEUED_WITH_FREE_KV)
    decision = run.until_change(QUEUED_STEADY)
    assert decision.knob == REPLICAS


def test_a_raise_is_judged_on_the_engines_work_not_on_generated_tokens_alone() -> None:
    """The first window after a rollout: the restarted engines prefill the queue again, so
    generated tokens dip while the work done (prompt + generated) holds (the live CPU test's
    numbers, where a raise that served as fast was reverted)."""
    before = dataclasses.replace(QUEUED_WITH_FREE_KV, generation_tokens_per_s=10.67,
                                 prompt_tokens_per_s=42.67)  # fmt: skip
    run = Run(settings(seqs=64), limits())
    run.until_change(before)
    run.step(window())
    refilling = dataclasses.replace(before, generation_tokens_per_s=1.28, prompt_tokens_per_s=40.95)
    decision = run.step(refilling)
    assert decision.action == "hold" and decision.verdict is not None, decision
    assert decision.verdict.startswith("kept maxNumSeqs 64 -> 128"), decision.verdict
    assert run.settings[MAX_NUM_SEQS] == 128


def test_a_raise_is_not_reverted_for_a_window_in_which_no_request_was_admitted() -> None:
    """Prompt tokens come with admissions, which wait for requests to finish: a window in
    which none finished admits none, and the engines' work looks cut by the missing
    prefill while decoding goes on about as fast (the live CPU test's numbers, where a
    raise that served as fast was reverted). Generated tokens held: kept."""
    before = dataclasses.replace(QUEUED_WITH_FREE_KV, generation_tokens_per_s=6.667,
                                 prompt_tokens_per_s=32.0)  # fmt: skip
    run = Run(settings(seqs=64), limits())
    run.until_change(before)
    run.step(window())
    no_admission = dataclasses.replace(before, generation_tokens_per_s=5.324,
                                       prompt_tokens_per_s=0.0)  # fmt: skip
    decision = run.step(no_admission)
    assert decision.action == "hold" and decision.verdict is not None, decision
    assert decision.verdict.startswith("kept maxNumSeqs 64 -> 128"), decision.verdict


def test_scale_down_that_broke_the_slo_is_reverted() -> None:
    run = measured(Run(settings(replicas=3), limits()), 10.0)
    assert run.until_change(IDLE).new == 2
    run.step(window())
    decision = run.step(window(ttft_p95_s=3.0))
    assert (decision.action, decision.knob, decision.new) == ("revert", REPLICAS, 3)
    assert "TTFT p95 0.1s -> 3s" in decision.reason


def test_scale_up_is_kept_while_a_backlog_drains() -> None:
    run = Run(settings(replicas=2), limits())
    assert run.until_change(QUEUED_WITH_FULL_KV).knob == REPLICAS
    run.step(window())
    draining = dataclasses.replace(QUEUED_WITH_FULL_KV, ttft_p95_s=20.0)
    decision = run.step(draining)
    assert decision.action == "hold" and decision.verdict is not None
    assert decision.verdict.startswith("kept replicas 2 -> 3")


def test_oom_after_raising_memory_is_reverted() -> None:
    run = Run(settings(memory=0.9), limits())
    assert run.until_change(KV_BOUND).new == 0.92
    run.step(window())
    decision = run.step(OOM)
    assert (decision.action, decision.new) == ("revert", 0.9)


def test_no_change_leaves_the_bounds_or_touches_a_fixed_knob() -> None:
    only_seqs = limits(
        bounds={MAX_NUM_SEQS: (8, 100)},
        fixed={REPLICAS: "pinned", GPU_MEMORY_UTILIZATION: "pinned"},
    )
    run = Run(settings(seqs=64), only_seqs)
    decision = run.until_change(QUEUED_WITH_FREE_KV)
    assert (decision.knob, decision.new) == (MAX_NUM_SEQS, 100)  # doubling, held to max
    run.wait_cooldown(QUEUED_WITH_FREE_KV)
    assert all(run.step(QUEUED_WITH_FREE_KV).action == "hold" for _ in range(10))
    assert all(run.step(OOM).knob in (None, MAX_NUM_SEQS) for _ in range(10))


def test_max_num_seqs_stays_within_max_num_batched_tokens() -> None:
    run = Run(settings(seqs=64), limits(max_num_batched_tokens=96))
    assert run.until_change(QUEUED_WITH_FREE_KV).new == 96


def test_value_outside_the_bounds_only_moves_back_inside() -> None:
    run = measured(Run(settings(replicas=12), limits()), 10.0)
    decision = run.until_change(IDLE)
    assert decision.new == 8  # clamped into [1, 8], not 11
    flood = window(requests_waiting=2000.0, kv_cache_usage=0.8)
    run = Run(settings(replicas=12, seqs=256), limits())
    assert all(run.step(flood).knob != REPLICAS for _ in range(10))


def test_a_knob_does_not_move_back_before_the_dwell() -> None:
    run = Run(settings(replicas=2, seqs=64), limits())
    assert run.until_change(QUEUED_WITH_FULL_KV).knob == REPLICAS
    run.wait_cooldown(IDLE)
    # Idle right after scaling up: the dwell (two cooldowns) keeps the new replica a while.
    decision = run.step(IDLE)
    assert decision.action == "hold"
    later = run.until_change(IDLE)
    assert later.knob == REPLICAS and later.new == later.old - 1


def test_recommend_mode_keeps_proposing_without_cooldown_or_watch() -> None:
    run = Run(settings(seqs=64), limits(), mode="Recommend")
    first = run.until_change(QUEUED_WITH_FREE_KV)
    second = run.step(QUEUED_WITH_FREE_KV)
    assert (first.knob, first.new) == (second.knob, second.new) == (MAX_NUM_SEQS, 128)
    assert run.state is not None and run.state["pending"] is None
    assert run.state["lastChangeTime"] is None
    assert run.settings[MAX_NUM_SEQS] == 64


def test_one_knob_per_decision_even_when_several_rules_fire() -> None:
    everything = dataclasses.replace(PREEMPTING, requests_waiting=100.0, ttft_p95_s=5.0)
    run = Run(settings(), limits())
    for _ in range(6):
        decision = run.step(everything)
        changed = [k for k in settings() if run.settings[k] != settings()[k]]
        assert len(changed) <= 1
        if decision.action == "change":
            break


def test_decide_does_not_modify_its_inputs() -> None:
    state = TunerState.from_status({"streaks": {"overload": 5}, "rejected": [], "lastMove": {}})
    current = settings()
    before = (repr(state), repr(current))
    decide(QUEUED_WITH_FREE_KV, current, limits(), state, now=1.0, mode="Auto")
    assert (repr(state), repr(current)) == before


def test_a_shift_in_prompt_length_voids_the_measured_rate() -> None:
    run = Run(settings(replicas=2), limits(), state=queued_since_last_window())
    run.step(dataclasses.replace(QUEUED_WITH_FULL_KV, prompt_tokens_per_s=20_000.0))
    assert run.state is not None and run.state["capacity"]["promptTokensPerRequest"] == 1000
    same_prompts = window(requests_per_s=19.0, ttft_p95_s=0.3, prompt_tokens_per_s=19_000.0)
    assert run.until_change(same_prompts).knob == REPLICAS
    run = Run(settings(replicas=2), limits(), state=queued_since_last_window())
    run.step(dataclasses.replace(QUEUED_WITH_FULL_KV, prompt_tokens_per_s=20_000.0))
    ten_times_longer = dataclasses.replace(same_prompts, prompt_tokens_per_s=190_000.0)
    assert all(run.step(ten_times_longer).action == "hold" for _ in range(10))
