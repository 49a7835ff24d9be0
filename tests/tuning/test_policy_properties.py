"""Properties of the policy over many windows: steadiness under noise, bounds always kept."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st
from pagoda_operator.tuning.policy import DEFAULT_CONFIG, KNOBS, REPLICAS, Limits, Snapshot

from .policy_cases import Run, limits, window
from .policy_cases import settings as current_settings

NOISE = 0.2  # each metric varies by up to ±20 % from one window to the next


@st.composite
def stationary_load(draw: st.DrawFn) -> Snapshot:
    """The mean of one window of any load: idle, queued, preempting, KV-bound, OOMing."""
    pods = draw(st.integers(1, 8))
    return window(
        pods=pods,
        kv_cache_usage=draw(st.floats(0.0, 1.0)),
        requests_waiting=draw(st.sampled_from([0.0, 0.05, 0.5, 2.0, 20.0, 500.0])) * pods,
        requests_running=draw(st.floats(0.0, 300.0)) * pods,
        preemptions_per_s=draw(st.sampled_from([0.0, 0.01, 0.2, 5.0])),
        ttft_p95_s=draw(st.one_of(st.none(), st.floats(0.01, 20.0))),
        itl_p95_s=draw(st.one_of(st.none(), st.floats(0.001, 0.5))),
        oom_kills=draw(st.sampled_from([None, 0.0, 0.0, 1.0])),
        requests_per_s=draw(st.floats(0.0, 500.0)),
        aborted_per_s=draw(st.sampled_from([0.0, 1.0, 50.0])),
        generation_tokens_per_s=draw(st.floats(0.0, 50_000.0)),
    )


def noisy(mean: Snapshot, rng: random.Random) -> Snapshot:
    def jitter(value: float | None) -> float | None:
        return None if value is None else value * rng.uniform(1 - NOISE, 1 + NOISE)

    return dataclasses.replace(
        mean,
        kv_cache_usage=min(1.0, jitter(mean.kv_cache_usage) or 0.0),
        requests_waiting=jitter(mean.requests_waiting) or 0.0,
        requests_running=jitter(mean.requests_running) or 0.0,
        preemptions_per_s=jitter(mean.preemptions_per_s) or 0.0,
        ttft_p95_s=jitter(mean.ttft_p95_s),
        itl_p95_s=jitter(mean.itl_p95_s),
        generation_tokens_per_s=jitter(mean.generation_tokens_per_s) or 0.0,
        requests_per_s=jitter(mean.requests_per_s) or 0.0,
        aborted_per_s=jitter(mean.aborted_per_s) or 0.0,
    )


@settings(max_examples=300, deadline=None)
@given(
    mean=stationary_load(),
    seed=st.integers(0, 2**32 - 1),
    start=st.tuples(
        st.integers(1, 8), st.sampled_from([8, 32, 64, 256]), st.sampled_from([0.8, 0.9])
    ),
)
def test_noisy_stationary_metrics_never_make_a_knob_oscillate(
    mean: Snapshot, seed: int, start: tuple[int, int, float]
) -> None:
    _check_steady(mean, seed, start)


def test_preemptions_below_the_cut_threshold_are_not_calm() -> None:
    """Found by the property above: preemptions around the per-engine threshold (0.2/s over
    4 engines, +-20 %) with the KV cache near empty. Windows above it cut maxNumSeqs by
    one; windows just below it counted as calm, and the calm raise (KV nearly empty: the
    slots would be the limit) put it back up: 256 -> 253 -> 256. A window with any
    preemption is not calm."""
    mean = window(pods=4, kv_cache_usage=1e-6, requests_waiting=0.2, requests_running=1112.6,
                  preemptions_per_s=0.2, ttft_p95_s=0.049, itl_p95_s=0.049,
                  generation_tokens_per_s=0.6, requests_per_s=213.2)  # fmt: skip
    _check_steady(mean, 4, (4, 32, 0.9))


def _check_steady(mean: Snapshot, seed: int, start: tuple[int, int, float]) -> None:
    rng = random.Random(seed)
    run = Run(current_settings(*start), limits())
    history = [run.settings]
    for _ in range(80):
        run.step(noisy(mean, rng))
        # Engines lent to cover an engine-knob change's rollout go back once it is judged:
        # not a move of replicas (when they stay, that is one).
        lent = (run.state or {}).get("cover") or {"engines": 0}
        history.append({**run.settings, REPLICAS: run.settings[REPLICAS] - lent["engines"]})
    for knob in KNOBS:
        values = [snapshot[knob] for snapshot in history]
        rises = any(b > a for a, b in zip(values, values[1:]))
        falls = any(b < a for a, b in zip(values, values[1:]))
        assert not (rises and falls), f"{knob} went both ways: {values}"


@settings(max_examples=200, deadline=None)
@given(
    windows=st.lists(stationary_load(), min_size=1, max_size=40),
    pinned=st.sets(st.sampled_from(KNOBS)),
)
def test_changes_stay_in_bounds_one_knob_at_a_time_and_spare_pinned_knobs(
    windows: list[Snapshot], pinned: set[str]
) -> None:
    base = limits()
    bounded = limits(
        bounds={k: v for k, v in base.bounds.items() if k not in pinned},
        fixed={k: "pinned" for k in pinned},
    )
    run = Run(current_settings(), bounded)
    for snapshot in windows:
        before = run.settings
        decision = run.step(snapshot)
        changed = [k for k in KNOBS if run.settings[k] != before[k]]
        assert len(changed) <= 1
        for knob in changed:
            assert knob not in pinned
            low, high = bounded.bounds[knob]
            assert low <= run.settings[knob] <= high, decision
        if REPLICAS in changed and decision.action == "change":  # a revert goes all the way back
            # At most tripled, unless clients give up or TTFT is far over target: then the
            # demand measured is added at once.
            if not severe(snapshot, bounded):
                assert run.settings[REPLICAS] <= (
                    DEFAULT_CONFIG.max_scale_up_factor * before[REPLICAS]
                )
            assert run.settings[REPLICAS] >= before[REPLICAS] - 1


def severe(snapshot: Snapshot, limits: Limits) -> bool:
    config = DEFAULT_CONFIG
    ttft = snapshot.ttft_p95_s
    return snapshot.aborted_per_s / max(snapshot.pods, 1) >= config.aborts_per_pod_s or (
        ttft is not None and ttft > config.severe_ttft_factor * limits.ttft_target_s
    )
