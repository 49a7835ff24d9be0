"""What structured outputs cost per step: the grammar engine's mask fill and its
application on the device, and the engine's decode step with and without constraints.

    python -m inference.bench.structured_check --out structured_h200.json

Two measurements at each batch size (default 1 and 64):

  ``mask``  B llguidance matchers walk through valid JSON documents of a realistic schema
            one token at a time; each step times filling the [B, vocab/32] bitmask on the
            host (``GrammarCompiler.fill_bitmask``, llguidance's thread pool) and applying
            it to [B, vocab] logits on the device (``apply_token_bitmask``, synchronised).
  ``step``  B requests decode ``--output-len`` tokens through the engine, unconstrained and
            then every row constrained (a fixed-length regex, so both runs decode the same
            number of steps); the mean decode-step time of each, and the difference.
            Constrained steps run synchronously (the next mask needs this step's token), so
            the difference includes the lost overlap of host and device work.

The mask's cost depends on the tokenizer (its size and its tokens): the default model is
the embedded SmolLM2-135M-Instruct (49,152 tokens). ``--model`` takes a model folder or a
named shape (random weights) and ``--tokenizer`` a tokenizer folder. Where the embedded model
is not installed (a GPU machine without network) and no tokenizer is given, the Qwen2.5-1.5B
shape runs with a byte-level BPE tokenizer of ``--synthetic-vocab`` tokens trained here on
JSON and prose (said so in the results): representative in kind, not of one real model.
Runs on CUDA and on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from inference.bench.common import random_prompts, record, write_json
from inference.model_shapes import SHAPES, resolve_shape_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "tags", "address"],
}


def _documents(count: int) -> list[str]:
    docs = []
    for i in range(count):
        docs.append(json.dumps({
            "name": f"Person number {i} with a longer name",
            "age": 20 + i % 100,
            "email": f"user.{i}@example.com",
            "tags": ["admin", "user", "guest"][: 1 + i % 3],
            "address": {"street": f"{i} Main Street", "city": "Springfield", "zip": "12345"},
            "score": 0.5,
        }, indent=2 if i % 2 else None))
    return docs


def synthetic_tokenizer(folder: str, vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on generated JSON and prose, saved in ``folder``."""
    import random

    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 10))) for _ in range(40_000)]
    corpus = [" ".join(rng.choices(words, k=40)) for _ in range(4_000)] + _documents(2_000)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    tok.save_pretrained(folder)
    return folder


def _embedded_model() -> str | None:
    from inference.model_files import ensure_default_model

    try:
        return str(ensure_default_model())
    except Exception:  # noqa: BLE001 - not installed: the caller falls back
        return None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure_mask(engine, batch: int) -> dict:
    """Per-step host fill and device apply of the bitmask for ``batch`` JSON rows."""
    import torch

    from inference.sampler import apply_token_bitmask
    from inference.sampling_params import StructuredOutputsParams

    grammars = engine.grammars
    spec = StructuredOutputsParams(json=SCHEMA)
    template = grammars.matcher(spec, grammars.check(spec)).result()
    docs = [engine.tokenizer.encode(d, add_special_tokens=False) for d in _documents(batch)]
    matchers = [template.deep_copy() for _ in range(batch)]
    vocab = engine.model_config.vocab_size
    device = engine.device if engine.device.type == "cuda" else torch.device("cpu")
    logits = torch.randn(batch, vocab, device=device)
    rows = list(range(batch))
    fills, applies = [], []
    num_steps = min(len(d) for d in docs)
    for step in range(num_steps):
        start = time.perf_counter()
        bitmask = grammars.fill_bitmask(matchers)
        fills.append(time.perf_counter() - start)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        apply_token_bitmask(logits, bitmask, rows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        applies.append(time.perf_counter() - start)
        for matcher, doc in zip(matchers, docs):
            if not matcher.consume_token(doc[step]):
                raise RuntimeError(f"document token rejected: {matcher.get_error()}")
    fills, applies = fills[2:], applies[2:]  # first steps build lexer state: warm-up
    return dict(
        batch_size=batch, steps=len(fills),
        fill_ms_mean=round(statistics.mean(fills) * 1e3, 4),
        fill_ms_p50=round(_percentile(fills, 0.5) * 1e3, 4),
        fill_ms_p99=round(_percentile(fills, 0.99) * 1e3, 4),
        apply_ms_mean=round(statistics.mean(applies) * 1e3, 4),
        apply_ms_p99=round(_percentile(applies, 0.99) * 1e3, 4),
    )


def _decode_steps(engine, prompts: list[list[int]], params) -> list[float]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    # The first steps prefill (and admit the grammar requests); the last drain.
    return times[3:-2] if len(times) > 8 else times


def measure_step(engine, batch: int, input_len: int, output_len: int) -> dict:
    from inference import SamplingParams, StructuredOutputsParams

    # Prompts the tokenizer can read (a named shape's vocabulary may be larger); no
    # detokenizing: random-weight models pick ids past a smaller tokenizer's end.
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    plain = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                           detokenize=False)
    # Letters and spaces for longer than output_len tokens can spell: ends by length.
    regex = StructuredOutputsParams(regex=f"[a-z ]{{{output_len * 16}}}")
    constrained = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                 detokenize=False, structured_outputs=regex)
    results = {}
    for name, params in (("plain", plain), ("constrained", constrained)) * 2:
        prompts = random_prompts(batch, input_len, vocab, seed=batch + len(results))
        results[name] = _decode_steps(engine, prompts, params)  # second round kept: warm
    plain_ms = statistics.mean(results["plain"]) * 1e3
    constrained_ms = statistics.mean(results["constrained"]) * 1e3
    return dict(
        input_len=input_len, output_len=output_len,
        step_ms_plain=round(plain_ms, 3), step_ms_constrained=round(constrained_ms, 3),
        step_ms_overhead=round(constrained_ms - plain_ms, 3),
        overhead_pct=round(100 * (constrained_ms - plain_ms) / plain_ms, 1),
    )


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="default",
                        help=f"model folder, 'default' (embedded SmolLM2) or {', '.join(SHAPES)}")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the model's; the embedded model's "
                        "for named shapes)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--synthetic-vocab", type=int, default=32_000,
                        help="size of the trained fallback tokenizer (see the module doc)")
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    return parser


def run(args: argparse.Namespace) -> int:
    import tempfile

    from inference import LLM

    model, tokenizer, tokenizer_kind = args.model, args.tokenizer, "the model's"
    if model == "default":
        embedded = _embedded_model()
        if embedded is None and tokenizer is None:
            model = "qwen2.5-1.5b"
            tokenizer = synthetic_tokenizer(tempfile.mkdtemp(prefix="pagoda-bpe-"),
                                            args.synthetic_vocab)
            tokenizer_kind = f"synthetic byte-level BPE ({args.synthetic_vocab})"
            print("the embedded model is not installed: qwen2.5-1.5b shape with a "
                  f"{tokenizer_kind} tokenizer", flush=True)
        elif embedded is not None:
            model = embedded
    if tokenizer is not None and tokenizer_kind == "the model's":
        tokenizer_kind = tokenizer
    elif model in SHAPES and tokenizer is None:
        tokenizer = _embedded_model()
        tokenizer_kind = "SmolLM2's"
        if tokenizer is None:
            raise SystemExit(f"{model} has no tokenizer: pass --tokenizer FOLDER")
    folder, extra = resolve_shape_model(model)
    batches = sorted(args.batch_size)
    llm = LLM(folder, tokenizer=tokenizer, device=args.device, max_num_seqs=max(batches),
              max_model_len=args.input_len + args.output_len + 8, **extra)
    engine = llm.engine
    rows = []
    for batch in batches:
        mask = measure_mask(engine, batch)
        step = measure_step(engine, batch, args.input_len, args.output_len)
        rows.append(record("structured_check", model=model if model in SHAPES else args.model,
                           tokenizer=tokenizer_kind, device=str(engine.device),
                           vocab_size=engine.model_config.vocab_size, **mask, **step))
    write_json(args.out, rows)
    print(f"\nstructured outputs on {engine.device} ({model}, model vocab "
          f"{engine.model_config.vocab_size}, tokenizer {tokenizer_kind}); ms per step")
    print(f"{'batch':>5} {'fill mean':>10} {'fill p99':>9} {'apply':>7} "
          f"{'step plain':>11} {'step constr.':>13} {'overhead':>9}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['fill_ms_mean']:>10.3f} {r['fill_ms_p99']:>9.3f} "
              f"{r['apply_ms_mean']:>7.3f} {r['step_ms_plain']:>11.3f} "
              f"{r['step_ms_constrained']:>13.3f} {r['overhead_pct']:>8.1f}%")
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    raise SystemExit(run(add_args(argparse.ArgumentParser(
        prog="python -m inference.bench.structured_check")).parse_args()))
