"""Host time of one step's outputs, in the engine process and in the server.

    python -m benchmarks.output_path_check [--rows 512] [--steps 50] [--repeats 5] [--tokenizer PATH]

Times, per step of ``--rows`` running completions (one new token each), the engine
process's share (``OutputProcessor.process_token`` for every row, ``make_output`` for every
request, ``EngineCore._rows`` and the pickling of the step's message) with the engine making
the text itself and with the text left to the server (as ``pagoda serve`` runs it), and the
server's share (unpickling and ``TextOutputs.process``). The tokens are a real text's, so
the detokenizers do their usual work; each request has a stop string that never matches
(its search runs every token). CPU only: no model runs. The tokenizer defaults to the
embedded SmolLM2's (49k byte-level BPE).
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import sys
import time

from inference.bench.common import record, write_json
from inference.config import EngineConfig
from inference.engine_core import EngineCore, _CoreRequest
from inference.engine_messages import StepOutputs
from inference.model_files import load_tokenizer
from inference.output_processor import OutputProcessor
from inference.sampling_params import RequestOutputKind, SamplingParams
from inference.sequence import Sequence
from inference.text_output import TextOutputs

TEXT = (
    "Kubernetes schedules pods onto nodes; an LLMDeployment names a model, its GPUs and how "
    "many engines serve it. Résumé: naïve café owners ☕ write 日本語 and emoji 🚀 too. "
) * 40


def _setup(tokenizer, rows: int, text: bool):
    processor = OutputProcessor(tokenizer, {tokenizer.eos_token_id}, 1 << 20)
    processor.text = text
    core = EngineCore(EngineConfig.from_kwargs("unused"), commands=None, outputs=None)
    requests, seqs = [], []
    for i in range(rows):
        params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, stop=["never-seen"])
        params.output_kind = RequestOutputKind.DELTA
        params.all_stop_token_ids = set()
        prompt = [tokenizer.bos_token_id or 1] * 8
        seq = Sequence(i, f"req-{i:05d}", 0, prompt, params)
        request = processor.new_request(seq.request_id, None, prompt, params, [seq], 0.0)
        core.requests[seq.request_id] = _CoreRequest(0.0)
        requests.append(request)
        seqs.append(seq)
    return processor, core, requests, seqs


def measure(tokenizer, rows: int, steps: int, text: bool) -> dict[str, float]:
    processor, core, requests, seqs = _setup(tokenizer, rows, text)
    server = TextOutputs()
    server.set_tokenizer(tokenizer, [tokenizer.eos_token_id])
    for request in requests:
        server.add(request.request_id, request.params)
    ids = tokenizer(TEXT).input_ids
    rng = random.Random(0)
    offsets = [rng.randrange(len(ids)) for _ in range(rows)]
    engine_s = server_s = 0.0
    for step in range(steps):
        start = time.perf_counter()
        for i, (request, seq) in enumerate(zip(requests, seqs)):
            token = ids[(offsets[i] + step) % len(ids)]
            seq.token_ids.append(token)
            processor.process_token(request, seq, token, None, 0.0)
        outputs = [o for o in (processor.make_output(r) for r in requests) if o is not None]
        data = pickle.dumps([StepOutputs(None, 0, core._rows(outputs, 0.0), None)])
        middle = time.perf_counter()
        if not text:
            [message] = pickle.loads(data)
            server.process(message.rows)
        else:
            pickle.loads(data)
        end = time.perf_counter()
        engine_s += middle - start
        server_s += end - middle
    # All the text made (the server's still holds back what the stop string could claim).
    if text:
        chars = sum(len(r.texts[0].text) for r in requests)
    else:
        chars = sum(len(server.requests[r.request_id].completions[0].text.text) for r in requests)
    return {"engine_ms": engine_s / steps * 1e3, "server_ms": server_s / steps * 1e3,
            "chars": chars}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.output_path_check")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", default=None, help="default: the embedded SmolLM2's")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        from inference.model_files import ensure_default_model

        args.tokenizer = str(ensure_default_model())
    tokenizer = load_tokenizer(args.tokenizer)
    # Alternating repeats, the fastest of each kept: a shared machine's noise only adds.
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for text in (True, False):
            runs[text].append(measure(tokenizer, args.rows, args.steps, text))
    in_engine = {k: min(r[k] for r in runs[True]) for k in runs[True][0]}
    in_server = {k: min(r[k] for r in runs[False]) for k in runs[False][0]}
    assert in_engine["chars"] == in_server["chars"], (in_engine, in_server)
    result = record("output_path", rows=args.rows, steps=args.steps, repeats=args.repeats,
                    text_in_engine=in_engine, text_in_server=in_server)  # fmt: skip
    result["command"] = "python -m benchmarks.output_path_check " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    write_json(args.output_json, result)
    print(json.dumps(result, indent=1))
    print(f"{'ms per step of ' + str(args.rows) + ' rows':<32}{'engine':>10}{'server':>10}")
    for name, row in (("text in the engine", in_engine), ("text in the server", in_server)):
        print(f"{name:<32}{row['engine_ms']:>10.3f}{row['server_ms']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
