"""A randomized constrained workload for the masks filled ahead of the launch
(``LLMEngine._start_fill_ahead``): requests of two JSON schemas and unconstrained ones,
greedy and seeded, arriving between steps, one aborted; run with the fill ahead on or off
(the executor's ``concurrent_results``), on the CPU or a GPU."""

from __future__ import annotations

import threading
import time

from inference import LLM, SamplingParams, StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta"]},
                                      "n": {"type": "integer"}},
     "required": ["kind", "n"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 5},
]  # fmt: skip
ARRIVALS = {0: 3, 2: 2, 5: 3, 9: 2}  # step -> how many requests arrive before it


def run_fill_ahead_workload(
    folder: str, ahead: bool, **engine
) -> tuple[dict[str, list[int]], dict[str, int], bool]:
    """Each finished request's tokens, how many fills ran ahead and in the launch and how
    many masks filled ahead were taken, and whether the scheduler preempted."""
    with LLM(folder, max_model_len=64, max_num_seqs=6, **engine) as llm:
        engine_ = llm.engine
        assert engine_.async_scheduling and engine_.runner.concurrent_results
        engine_.runner.concurrent_results = ahead
        fills = {"ahead": 0, "launch": 0}
        fill = engine_.grammars.fill_bitmask

        def counted(matchers):
            on_ahead_thread = threading.current_thread().name.startswith("fill-ahead")
            fills["ahead" if on_ahead_thread else "launch"] += 1
            return fill(matchers)

        engine_.grammars.fill_bitmask = counted
        join = engine_._join_fill_ahead
        fills["taken"] = 0

        def taken(step):  # masks a launch (or a completion) took from a fill ahead
            result = join(step)
            fills["taken"] += result is not None
            return result

        engine_._join_fill_ahead = taken
        tokens: dict[str, list[int]] = {}
        step = added = 0
        while step <= max(ARRIVALS) or engine_.has_unfinished_requests():
            for _ in range(ARRIVALS.get(step, 0)):
                spec = StructuredOutputsParams(json=SCHEMAS[added % 2], disable_any_whitespace=True)
                params = SamplingParams(
                    temperature=1.0 if added % 2 else 0.0, seed=added, max_tokens=24 + added,
                    structured_outputs=None if added % 5 == 4 else spec)  # fmt: skip
                engine_.add_request(f"req-{added}", f"the cat {added} sat", params)
                added += 1
            if step == 7:
                engine_.abort_request("req-1")
            # Matchers are built on a thread pool and a request joins the batch at the first
            # step after its own is done: wait for them, so both runs schedule alike.
            deadline = time.monotonic() + 60
            while any(not future.done() for _, future in engine_._awaiting_grammar):
                assert time.monotonic() < deadline, "matchers not built in 60 s"
                time.sleep(0.005)
            for output in engine_.step():
                if output.finished:
                    tokens[output.request_id] = list(output.outputs[0].token_ids)
            step += 1
        return tokens, fills, engine_.scheduler.num_preemptions > 0
