"""llguidance against xgrammar as libraries: the same JSON schema, tokenizer and documents
as ``structured_check``, fill and advance per decode step for a batch of rows.

    python -m benchmarks.grammar_libraries --tokenizer DIR [--batch-size 64 256] [--out F]

llguidance runs as the engine runs it (rows cloned in turn from twice as many templates as
fill threads, advances one after the other) and with one template and one thread; xgrammar (not a dependency: installed beside it when there)
runs its ``BatchGrammarMatcher`` with 1, 4 and 8 threads. Times are host wall time per
step, the first two steps (lexer warm-up) left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks import structured_check as sc
from inference.bench.common import record, write_json
from inference.structured_output import FILL_THREADS

TEMPLATES = 1 if FILL_THREADS == 1 else 2 * FILL_THREADS  # GrammarCompiler's rule
VOCAB = 151_936  # the Qwen2.5 models' (padded) vocabulary: the mask's width


def _summary(lib: str, mode: str, batch: int, fills: list, advances: list) -> dict:
    fills, advances = fills[2:], advances[2:]
    return dict(lib=lib, mode=mode, batch=batch, steps=len(fills),
                fill_ms_mean=round(statistics.mean(fills) * 1e3, 3),
                fill_ms_p50=round(statistics.median(fills) * 1e3, 3),
                fill_ms_max=round(max(fills) * 1e3, 2),
                advance_ms_mean=round(statistics.mean(advances) * 1e3, 3))  # fmt: skip


def llguidance_rows(tokenizer, docs: list[list[int]], fill_threads: int | None) -> tuple:
    from inference.sampling_params import StructuredOutputsParams
    from inference.structured_output import GrammarCompiler

    grammars = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])
    grammars.fill_threads = fill_threads
    spec = StructuredOutputsParams(json=sc.SCHEMA)
    template = grammars.matcher(spec, grammars.check(spec)).result()
    matchers = [template.deep_copy() for _ in docs]
    fills, advances = [], []
    for step in range(min(len(d) for d in docs)):
        start = time.perf_counter()
        grammars.fill_bitmask(matchers)
        fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        ended = grammars.advance(matchers, [d[step] for d in docs])
        advances.append(time.perf_counter() - start)
        assert not any(m.is_error() for m in matchers) and (
            not any(ended) or step + 1 == len(docs[0])
        )
    return fills, advances


def xgrammar_rows(tokenizer, docs: list[list[int]], threads: int) -> tuple:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(sc.SCHEMA))
    bitmask = xgrammar.allocate_token_bitmask(len(docs), VOCAB)
    batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in docs]
    fills, advances = [], []
    for step in range(min(len(d) for d in docs)):
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        accepted = xgrammar.BatchGrammarMatcher.batch_accept_token(
            matchers, [d[step] for d in docs]
        )
        advances.append(time.perf_counter() - start)
        assert all(accepted)
    return fills, advances


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(prog="python -m benchmarks.grammar_libraries")
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    try:
        import xgrammar  # noqa: F401

        has_xgrammar = True
    except ImportError:
        has_xgrammar = False
        print("xgrammar is not installed: llguidance only")
    results = []
    for batch in args.batch_size:
        docs = [tokenizer.encode(d, add_special_tokens=False) for d in sc._documents(batch)]
        runs = [
            (
                "llguidance",
                f"engine ({FILL_THREADS} threads, {TEMPLATES} templates)",
                llguidance_rows,
                FILL_THREADS,
            ),
            ("llguidance", "one template, 1 thread", llguidance_rows, 1),
        ]
        if has_xgrammar:
            runs += [("xgrammar", f"batch, {n} threads", xgrammar_rows, n) for n in (1, 4, 8)]
        for lib, mode, run, threads in runs:
            row = _summary(lib, mode, batch, *run(tokenizer, docs, threads))
            results.append(record("grammar_libraries", **row))
            print(json.dumps(row), flush=True)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
