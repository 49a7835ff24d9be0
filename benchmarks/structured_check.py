"""What structured outputs cost per step: the grammar engine's mask fill and its
application on the device, and the engine's decode step with and without constraints,
split into phases.

    python -m benchmarks.structured_check --out structured_h200.json
    python -m benchmarks.structured_check --smoke     # CPU smoke test, seconds

Two measurements at each batch size (default 1 and 64):

  ``mask``  B llguidance matchers walk through valid JSON documents of a realistic schema
            one token at a time; each step times advancing the matchers by a token
            (``GrammarCompiler.advance``), filling the [B, vocab/32] bitmask on the host
            (``GrammarCompiler.fill_bitmask``, llguidance's thread pool) and applying it to
            [B, vocab] logits on the device (``apply_token_bitmask``, synchronised).
  ``step``  B requests decode ``--output-len`` tokens through the engine, unconstrained and
            then every row constrained; the mean decode-step time of each, the difference,
            and where each step's host time goes (below). The constraint (``--step-grammar``)
            is by default an array of at least 16 objects of the same schema, compact, which
            no row can finish within ``--output-len`` tokens, so both runs decode the same
            number of steps; ``regex`` is the fixed-length ``[a-z ]{16 x output-len}`` the
            first measurement used: a counted repetition, whose every position is a new
            lexer state, so each row's fill walks the token trie (about 0.3 ms a row on
            one core, 40 times a typical JSON row).

Phases of a step (host wall time, ms per step; nested ones are part of their parent):
``schedule`` (the scheduler), ``launch`` (inputs, queueing the forward pass and the
sampling; on CPU it runs them), within it ``advance`` (the matchers consume the previous
step's tokens), ``fill`` and ``apply`` (the mask; on a GPU ``apply`` only queues the
kernel), ``complete`` (the previous step's tokens: stop checks, outputs), ``wait`` (for
the device to hand back sampled tokens: inside ``launch`` when the fill needs them,
inside ``complete`` otherwise) and ``other`` (the rest of ``LLMEngine.step``). On one
device the matchers advance and fill on a thread of their own as soon as a step is
launched (``LLMEngine._start_fill_ahead``): ``advance`` and ``fill`` are then that thread's
time, off the engine thread, and ``join`` (inside ``launch``) is what the launch still
waits for them; on a GPU they also overlap the forward pass.

The mask's cost depends on the tokenizer (its size and its tokens): the default model is
the embedded SmolLM2-135M-Instruct (49,152 tokens). ``--model`` takes a model folder, a
named shape (random weights) or ``tiny`` (a two-layer random model with the tokenizer's
vocabulary: the host's costs without the model's) and ``--tokenizer`` a tokenizer folder.
Where the embedded model is not installed (a GPU machine without network) and no tokenizer
is given, the Qwen2.5-1.5B shape runs with a byte-level BPE tokenizer of
``--synthetic-vocab`` tokens trained here on JSON and prose (said so in the results):
representative in kind, not of one real model. Runs on CUDA and on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

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


# A step-benchmark constraint no row can complete within the measured tokens.
STEP_SCHEMA = {"type": "array", "items": SCHEMA, "minItems": 16}
# A tiny random model for --model tiny: the engine's host costs without a model's.
TINY = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "torch_dtype": "float32", "eos_token_id": 0,
}  # fmt: skip
PHASES = ("schedule", "launch", "advance", "fill", "join", "apply", "complete", "wait", "other")


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
    fills, applies, advances = [], [], []
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
        tokens = [doc[step] for doc in docs]
        start = time.perf_counter()
        ended = grammars.advance(matchers, tokens)
        advances.append(time.perf_counter() - start)
        if any(m.is_error() for m in matchers) or (any(ended) and step + 1 < num_steps):
            raise RuntimeError("a document token was rejected or ended the grammar early")
    # The first steps build lexer state: warm-up.
    fills, applies, advances = fills[2:], applies[2:], advances[2:]
    return dict(
        batch_size=batch, steps=len(fills),
        fill_ms_mean=round(statistics.mean(fills) * 1e3, 4),
        fill_ms_p50=round(_percentile(fills, 0.5) * 1e3, 4),
        fill_ms_p99=round(_percentile(fills, 0.99) * 1e3, 4),
        apply_ms_mean=round(statistics.mean(applies) * 1e3, 4),
        apply_ms_p99=round(_percentile(applies, 0.99) * 1e3, 4),
        advance_ms_mean=round(statistics.mean(advances) * 1e3, 4),
    )


class PhaseTimer:
    """Host wall time spent inside the engine's phases: wraps the callables it is given
    (an instance's or a class's attribute) and sums their time per phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        # (phase, thread name, start, end) of every call, when a timeline is wanted
        self.events: list[tuple[str, str, float, float]] | None = None
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: object, attr: str, phase: str) -> None:
        if not hasattr(owner, attr):
            return  # not in this engine: the phase stays 0 and shows under "other"
        original = getattr(owner, attr)
        seconds = self.seconds
        timer = self

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                end = time.perf_counter()
                seconds[phase] += end - start
                if timer.events is not None:
                    timer.events.append(
                        (phase, threading.current_thread().name, start, end))

        had_own = attr in vars(owner)
        setattr(owner, attr, timed)
        self._undo.append(
            (lambda: setattr(owner, attr, original)) if had_own else (lambda: delattr(owner, attr))
        )

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def _engine_phases(engine, spans: bool = False) -> PhaseTimer:
    from inference import llm_engine, sampler

    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "launch", "launch")
    timer.wrap(engine.grammars, "advance", "advance")
    timer.wrap(engine.grammars, "fill_bitmask", "fill")
    timer.wrap(sampler, "apply_token_bitmask", "apply")
    timer.wrap(engine, "_complete", "complete")
    timer.wrap(engine, "_join_fill_ahead", "join")
    timer.wrap(llm_engine._LaunchedStep, "result", "wait")
    if spans:  # finer spans, for the timeline only (not phases)
        timer.wrap(engine.grammars, "_empty_bitmask", "alloc")
        timer.wrap(engine, "_start_fill_ahead", "start_ahead")
        timer.wrap(engine, "_emit", "emit")
        timer.events = []
    return timer


def _decode_steps(
    engine, prompts: list[list[int]], params, timeline: list | None = None
) -> tuple[list[float], dict]:
    """Per-step times of a batch's decode, and the mean ms per step of each phase."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    timer = _engine_phases(engine, spans=timeline is not None)
    times, phases = [], []
    try:
        while engine.has_unfinished_requests():
            before = dict(timer.seconds)
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            if timer.events is not None:
                timer.events.append(("step", "engine", start, start + times[-1]))
            phases.append({k: v - before.get(k, 0.0) for k, v in timer.seconds.items()})
    finally:
        timer.restore()
    if timeline is not None:  # every decode run's (phase, thread, start, end) spans
        timeline.append(timer.events)
    # The first steps prefill (and admit the grammar requests); the last drain.
    keep = slice(3, -2) if len(times) > 8 else slice(None)
    times, phases = times[keep], phases[keep]
    means = {p: statistics.mean(step.get(p, 0.0) for step in phases) * 1e3 for p in PHASES}
    means["other"] = statistics.mean(times) * 1e3 - sum(
        means[p] for p in ("schedule", "launch", "complete")
    )
    return times, {p: round(v, 3) for p, v in means.items()}


def step_constraint(kind: str, output_len: int):
    from inference import StructuredOutputsParams

    if kind == "regex":
        # Letters and spaces for longer than output_len tokens can spell: ends by length.
        return StructuredOutputsParams(regex=f"[a-z ]{{{output_len * 16}}}")
    return StructuredOutputsParams(json=STEP_SCHEMA, disable_any_whitespace=True)


def measure_step(engine, batch: int, input_len: int, output_len: int,
                 grammar: str = "json", in_launch: bool = False,
                 timeline: list | None = None) -> dict:
    from inference import SamplingParams

    # Prompts the tokenizer can read (a named shape's vocabulary may be larger); no
    # detokenizing: random-weight models pick ids past a smaller tokenizer's end.
    vocab = min(engine.model_config.vocab_size, len(engine.tokenizer))
    plain = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                           detokenize=False)
    constrained = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                 detokenize=False,
                                 structured_outputs=step_constraint(grammar, output_len))
    runs = [("plain", plain), ("constrained", constrained)]
    if in_launch and engine.runner.concurrent_results:
        runs.append(("constrained_in_launch", constrained))
    results: dict[str, tuple[list[float], dict]] = {}
    ahead = engine.runner.concurrent_results
    try:
        for name, params in runs * 2:
            # The fill ahead off: masks filled in the launch, as before it existed.
            engine.runner.concurrent_results = ahead and name != "constrained_in_launch"
            prompts = random_prompts(batch, input_len, vocab, seed=batch + len(results))
            results[name] = _decode_steps(engine, prompts, params, timeline)  # 2nd kept: warm
    finally:
        engine.runner.concurrent_results = ahead
    plain_ms = statistics.mean(results["plain"][0]) * 1e3
    constrained_ms = statistics.mean(results["constrained"][0]) * 1e3
    extra = {}
    if "constrained_in_launch" in results:
        extra = dict(step_ms_constrained_in_launch=round(
                         statistics.mean(results["constrained_in_launch"][0]) * 1e3, 3),
                     phases_ms_constrained_in_launch=results["constrained_in_launch"][1])
    return dict(**extra,
        input_len=input_len, output_len=output_len, step_grammar=grammar,
        step_ms_plain=round(plain_ms, 3), step_ms_constrained=round(constrained_ms, 3),
        step_ms_overhead=round(constrained_ms - plain_ms, 3),
        overhead_pct=round(100 * (constrained_ms - plain_ms) / plain_ms, 1),
        phases_ms_plain=results["plain"][1], phases_ms_constrained=results["constrained"][1],
    )


def tiny_model(vocab_size: int) -> str:
    """A folder with the config of ``TINY`` at ``vocab_size`` (weights: random)."""
    folder = Path(tempfile.mkdtemp(prefix="pagoda-tiny-"))
    (folder / "config.json").write_text(json.dumps({**TINY, "vocab_size": vocab_size}))
    return str(folder)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default="default",
                        help="model folder, 'default' (embedded SmolLM2), 'tiny' or "
                        f"{', '.join(SHAPES)}")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the model's; the embedded model's "
                        "for named shapes)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--step-grammar", default="json", choices=["json", "regex"],
                        help="the step measurement's constraint (see the module doc)")
    parser.add_argument("--fill-threads", type=int, default=None,
                        help="llguidance's threads for batched mask fills (default: the "
                        "engine's, half the CPUs up to 8; 0: llguidance's own, 80%% of the "
                        "CPUs up to 32)")
    parser.add_argument("--in-launch", action="store_true",
                        help="also time constrained steps with the masks filled in the "
                        "launch (the fill ahead off), same engine")
    parser.add_argument("--timeline", default=None,
                        help="write every decode run's spans per thread here (JSON)")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick check: --model tiny, batches 1 and 8, 16 in / 16 out")
    parser.add_argument("--synthetic-vocab", type=int, default=32_000,
                        help="size of the trained fallback tokenizer (see the module doc)")
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    return parser


def run(args: argparse.Namespace) -> int:
    from inference import LLM
    from inference.model_files import load_tokenizer

    if args.smoke:
        args.model, args.batch_size, args.input_len, args.output_len = "tiny", [1, 8], 16, 16
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
    elif (model in SHAPES or model == "tiny") and tokenizer is None:
        tokenizer = _embedded_model()
        tokenizer_kind = "SmolLM2's"
        if tokenizer is None:
            raise SystemExit(f"{model} has no tokenizer: pass --tokenizer FOLDER")
    if model == "tiny":
        folder, extra = tiny_model(len(load_tokenizer(tokenizer))), {"load_format": "dummy"}
    else:
        folder, extra = resolve_shape_model(model)
    batches = sorted(args.batch_size)
    llm = LLM(folder, tokenizer=tokenizer, device=args.device, max_num_seqs=max(batches),
              max_model_len=args.input_len + args.output_len + 8, **extra)
    engine = llm.engine
    if args.fill_threads is not None:
        engine.grammars.fill_threads = args.fill_threads or None
    timeline: list | None = [] if args.timeline else None
    rows = []
    for batch in batches:
        mask = measure_mask(engine, batch)
        step = measure_step(engine, batch, args.input_len, args.output_len, args.step_grammar,
                            args.in_launch, timeline)
        rows.append(record("structured_check",
                           model=model if model in SHAPES or model == "tiny" else args.model,
                           tokenizer=tokenizer_kind, device=str(engine.device),
                           fill_threads=engine.grammars.fill_threads or "llguidance default",
                           vocab_size=engine.model_config.vocab_size, **mask, **step))
    write_json(args.out, rows)
    if args.timeline:
        Path(args.timeline).write_text(json.dumps(timeline))
    print(f"\nstructured outputs on {engine.device} ({model}, model vocab "
          f"{engine.model_config.vocab_size}, tokenizer {tokenizer_kind}); ms per step")
    print(f"{'batch':>5} {'fill mean':>10} {'fill p99':>9} {'apply':>7} {'advance':>8} "
          f"{'step plain':>11} {'step constr.':>13} {'overhead':>9}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['fill_ms_mean']:>10.3f} {r['fill_ms_p99']:>9.3f} "
              f"{r['apply_ms_mean']:>7.3f} {r['advance_ms_mean']:>8.3f} "
              f"{r['step_ms_plain']:>11.3f} {r['step_ms_constrained']:>13.3f} "
              f"{r['overhead_pct']:>8.1f}%"
              + (f"  (in the launch: {r['step_ms_constrained_in_launch']:.3f})"
                 if "step_ms_constrained_in_launch" in r else ""))
    print(f"\nwhere a decode step's host time goes ({args.step_grammar} constraint), ms per step")
    print(f"{'batch':>5} {'run':>21} " + " ".join(f"{p:>8}" for p in PHASES))
    for r in rows:
        for run_name in ("plain", "constrained", "constrained_in_launch"):
            phases = r.get(f"phases_ms_{run_name}")
            if phases is None:
                continue
            print(f"{r['batch_size']:>5} {run_name:>21} "
                  + " ".join(f"{phases[p]:>8.3f}" for p in PHASES))
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    raise SystemExit(run(add_args(argparse.ArgumentParser(
        prog="python -m benchmarks.structured_check")).parse_args()))
