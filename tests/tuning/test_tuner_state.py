"""``status.tuning.state``: the typed state reads what existing LLMDeployments hold and
writes back exactly the same keys."""

from __future__ import annotations

import copy
import json

from pagoda_operator.tuning.state import TunerState

# A state as a window of the tuner writes it, every field set: a covered maxNumSeqs change
# rolling out, with a ban, a move and a saturated rate measured.
STORED = {
    "streaks": {"overload": 0, "idle": 1, "preempting": 0, "kvBound": 0, "kvBusy": 2,
                "calm": 3, "nearTarget": 0, "busy": 0, "queued": 0},
    "capacity": {"requestsPerPod": 10.5, "promptTokensPerRequest": 812.0, "time": 1000.0},
    "pending": {"knob": "maxNumSeqs", "from": 64, "to": 128, "time": 1060.0,
                "settledTime": None, "baseline": {"pods": 3, "ttftP95Seconds": 0.4}},
    "cover": {"phase": "rolling", "knob": "maxNumSeqs", "from": 64, "to": 128,
              "reason": "calm", "engines": 1, "replicas": 3,
              "baseline": {"pods": 2, "ttftP95Seconds": 0.4}},
    "lastChangeTime": 1060.0,
    "lastMove": {"maxNumSeqs": {"direction": 1, "time": 1060.0},
                 "replicas": {"direction": -1, "time": 400.0}},
    "rejected": [{"knob": "gpuMemoryUtilization", "value": 0.92, "direction": 1,
                  "until": 4000.0}],
    "lastOomTime": 300.0,
    "lastKvUsage": 0.41,
}  # fmt: skip


def test_a_stored_state_round_trips_unchanged() -> None:
    stored = copy.deepcopy(STORED)
    assert TunerState.from_status(stored).to_status() == STORED
    assert stored == STORED  # reading does not touch the status


def test_the_cover_flag_of_a_pending_replica_change_round_trips() -> None:
    stored = copy.deepcopy(STORED)
    stored["pending"] = {"knob": "replicas", "from": 2, "to": 3, "time": 1.0,
                         "settledTime": 5.0, "baseline": {}, "cover": True}  # fmt: skip
    stored["cover"] = {**STORED["cover"], "phase": "adding"}
    assert TunerState.from_status(stored).to_status() == stored


def test_a_merge_patched_state_reads_its_absent_keys_as_unset() -> None:
    """A merge patch (RFC 7386) removes a key written as null, so the API server returns
    the state without them; each reads back as unset and is written again, as null."""
    stored = json.loads(json.dumps(STORED))
    for key in ("capacity", "cover", "lastOomTime"):
        del stored[key]
    del stored["pending"]["settledTime"]
    written = TunerState.from_status(stored).to_status()
    assert written["capacity"] is None and written["cover"] is None
    assert written["lastOomTime"] is None and written["pending"]["settledTime"] is None
    assert set(written) == set(STORED)


def test_a_first_window_starts_from_nothing() -> None:
    empty = TunerState.from_status(None).to_status()
    assert empty["streaks"] == dict.fromkeys(STORED["streaks"], 0)
    assert empty["lastMove"] == {} and empty["rejected"] == []
    assert set(empty) == set(STORED)


def test_a_saturated_rate_with_what_its_window_showed_round_trips() -> None:
    # Written since the rate follows a change of maxNumSeqs (capacity.at_max_num_seqs); a
    # state without these keys (STORED's) reads and writes back without them.
    stored = copy.deepcopy(STORED)
    stored["capacity"] |= {"maxNumSeqs": 256, "requestsRunningPerPod": 237.2,
                           "itlP95Seconds": 0.0191, "kvCacheUsage": 0.07}  # fmt: skip
    state = TunerState.from_status(stored)
    assert state.capacity is not None and state.capacity.max_num_seqs == 256
    assert state.to_status() == stored
