"""Shared pieces of the benchmarks: named real-model shapes with random weights, and the
result record every published run keeps (benchmarks/results/*.json)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from inference import config
from inference.model_shapes import SHAPES


def hardware() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    except ImportError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def commit() -> str:
    """The checkout's commit; PAGODA_COMMIT names it where the tree has no .git (a copied
    working tree on a benchmark machine)."""
    if os.environ.get("PAGODA_COMMIT"):
        return os.environ["PAGODA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, cwd=Path(__file__).parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(workload: str, **fields: Any) -> dict[str, Any]:
    return {
        "workload": workload,
        **fields,
        "hardware": hardware(),
        "commit": commit(),
        "command": _command_line(workload),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _command_line(workload: str) -> str:
    """The command as a user would type it, also when run as ``python -m inference.bench.X``."""
    args = sys.argv[1:]
    if sys.argv and Path(sys.argv[0]).stem == workload:
        return " ".join(["pagoda", "bench", workload, *args])
    return " ".join(["pagoda", *args])


def write_json(path: str | None, result: dict[str, Any] | list[dict[str, Any]]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def bench_main(add_args, run, prog: str, argv: list[str] | None = None) -> int:
    """``python -m inference.bench.X``: the same bench as ``pagoda bench X``, for machines
    where the server's dependencies are missing."""
    import argparse
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return run(add_args(argparse.ArgumentParser(prog=prog)).parse_args(argv))


# With no --model: a real serving shape on a GPU; on CPU, where that shape takes minutes
# a run, the embedded SmolLM2-135M-Instruct.
GPU_DEFAULT_MODEL = "qwen2.5-1.5b"
CPU_DEFAULT_MODEL = "default"


def add_engine_args(parser) -> None:
    """The model (a folder or a named shape) and every engine flag of ``pagoda serve``."""
    parser.add_argument("--model", default=None,
                        help=f"model folder, 'default' (the embedded SmolLM2-135M-Instruct) or "
                        f"a named shape with random weights: {', '.join(SHAPES)}, each also with "
                        f"a 4-bit suffix -awq, -gptq or -w4a16 (default: "
                        f"{GPU_DEFAULT_MODEL} on a GPU, the embedded model on CPU)")
    config.add_engine_args(parser, exclude=("served_model_name",))
    add_output_args(parser)


def spec_decode_counts(engine) -> tuple[int, int, int]:
    """(verifying steps x sequences, draft tokens, accepted tokens) so far; zeros when
    speculative decoding is off. Two readings bracket a measurement."""
    decoder = getattr(engine, "spec_decoder", None)
    if decoder is None:
        return (0, 0, 0)
    c = decoder.counters
    return (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens)


def spec_decode_summary(engine, since: tuple[int, int, int] = (0, 0, 0)) -> dict:
    """Speculative decoding since the reading ``since``: the mean acceptance length
    (tokens per verifying step and sequence: accepted drafts + the target's own) and the
    acceptance rate (accepted / proposed draft tokens); {} when it is off."""
    decoder = getattr(engine, "spec_decoder", None)
    if decoder is None:
        return {}
    drafts, draft_tokens, accepted = (
        now - before for now, before in zip(spec_decode_counts(engine), since))
    return {
        "speculative_method": decoder.config.method,
        "num_speculative_tokens": decoder.config.num_speculative_tokens,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
    }


def spec_decode_line(summary: dict) -> str:
    return (f"speculative decoding ({summary['speculative_method']}, k="
            f"{summary['num_speculative_tokens']}): mean acceptance length "
            f"{summary['mean_acceptance_length']:.2f}, acceptance rate "
            f"{100 * summary['acceptance_rate']:.1f} %")


def add_workload_args(parser) -> None:
    parser.add_argument("--workload", choices=["random", "copy"], default="random",
                        help="random: random token ids of --input-len; copy: each prompt a "
                        "document of --document-len tokens to be copied (copy-heavy, where "
                        "n-gram speculation pays; the copy rate measured is reported)")
    parser.add_argument("--document-len", type=int, default=2048,
                        help="tokens of each --workload copy document")
    parser.add_argument("--copy-model", action="store_true",
                        help="--workload copy on a named shape: set its random weights so that "
                        "it copies the documents (full-size kernels, a copy rate you choose "
                        "with --copy-miss-rate), where random weights copy nothing")
    parser.add_argument("--copy-miss-rate", type=float, default=0.0,
                        help="with --copy-model: the share of document tokens the model does "
                        "not copy (it emits a token of its own there)")
    parser.add_argument("--draft-copy-miss-rate", type=float, default=0.3,
                        help="with --copy-model and a named-shape draft model "
                        "(--speculative-config '{\"method\": \"draft_model\", \"model\": "
                        "\"qwen2.5-0.5b\"}'): the draft is a copier too, missing this share "
                        "of the tokens the target copies (its acceptance rate, about)")


def copy_model_folder(args, folder: str, extra: dict) -> None:
    """``--copy-model``, before the engine loads: checks it applies, gives the named
    shape's config its own LM head (the same bytes a step reads as a tied one) and sets
    ``args.copy_chain``, the chain the documents and the weights follow."""
    args.copy_chain = None
    if not args.copy_model:
        return
    if args.workload != "copy" or extra.get("load_format") != "dummy":
        raise SystemExit("--copy-model needs --workload copy and a named shape (--model "
                         "qwen2.5-1.5b, ...): it rewrites random weights")
    if (args.tensor_parallel_size or 1) > 1 or args.quantization:
        raise SystemExit("--copy-model runs unquantized at --tensor-parallel-size 1")
    from inference.bench.copy_workload import CopyChain

    config_path = Path(folder) / "config.json"
    shape = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(shape | {"tie_word_embeddings": False}))
    args.copy_chain = CopyChain(shape["vocab_size"], args.document_len, args.copy_miss_rate)
    args.draft_copy_chain = _draft_copier(args, shape["vocab_size"])


def _draft_copier(args, vocab_size: int):
    """A named-shape draft model under ``--copy-model``: its folder made here (untied, and
    with the target's vocabulary size, as Qwen2.5's small models pad theirs to the large
    ones'), named in ``args.speculative_config``; the chain it follows (the target's chain
    with ``--draft-copy-miss-rate`` of its links broken). None for other drafts."""
    from inference.bench.copy_workload import CopyChain
    from inference.model_shapes import resolve_shape_model, shape_config
    from inference.spec_decode.config import parse_speculative_config

    spec = parse_speculative_config(args.speculative_config)
    if spec is None or spec.method != "draft_model" or shape_config(spec.model) is None:
        return None
    folder, _ = resolve_shape_model(spec.model)
    config_path = Path(folder) / "config.json"
    shape = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(shape | {"tie_word_embeddings": False,
                                               "vocab_size": vocab_size}))
    given = args.speculative_config
    given = json.loads(given) if isinstance(given, str) else dict(given)
    args.speculative_config = json.dumps(given | {"model": folder})
    return CopyChain(vocab_size, args.document_len, args.draft_copy_miss_rate)


def install_copy_model(args, engine) -> None:
    """``--copy-model``, once the engine is up: the copier's weights (``make_copier``)."""
    if getattr(args, "copy_chain", None) is not None:
        from inference.bench.copy_workload import make_copier

        make_copier(engine.runner.model, args.copy_chain)
        if args.draft_copy_chain is not None:
            make_copier(engine.spec_decoder.draft.runner.model, args.draft_copy_chain)


def workload_input_len(args) -> int:
    """The longest prompt ``--workload`` makes (what max_model_len must hold)."""
    if args.workload == "copy":
        from inference.bench.copy_workload import PROMPT_OVERHEAD_TOKENS

        return args.document_len + PROMPT_OVERHEAD_TOKENS
    lengths = args.input_len  # latency sweeps several
    return max(lengths) if isinstance(lengths, list) else lengths


def workload_prompts(args, engine, num: int, length: int, seed: int = 0) -> list[list[int]]:
    """The prompts of ``--workload``: random ids of ``length``, or copy documents."""
    vocab = engine.model_config.vocab_size
    if args.workload == "copy":
        from inference.bench.copy_workload import copy_prompts

        return copy_prompts(engine.tokenizer, num, args.document_len, vocab, seed,
                            getattr(args, "copy_chain", None))
    return random_prompts(num, length, vocab, seed)


def workload_summary(args, prompts: list[list[int]], outputs) -> dict:
    """What the records say of ``--workload``: its name, and for copy the document length
    and the copy rate measured on these outputs."""
    if args.workload != "copy":
        return {}
    from inference.bench.copy_workload import copy_rate

    generated = [o.outputs[0].token_ids for o in outputs]
    copier = {}
    if getattr(args, "copy_chain", None) is not None:
        copier = {"copy_model": True, "copy_miss_rate": args.copy_miss_rate}
        if args.draft_copy_chain is not None:
            copier["draft_copy_miss_rate"] = args.draft_copy_miss_rate
    return {"prompt_workload": "copy", "document_len": args.document_len, **copier,
            "prompt_len_mean": round(sum(map(len, prompts)) / len(prompts), 1),
            "copy_rate": round(copy_rate(prompts, generated), 4)}


def add_output_args(parser) -> None:
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, metavar="DIR",
                        help="write PNG plots of this run into DIR")


def bench_model(args) -> str:
    """``--model``, or the default for the device the bench runs on (set on ``args``)."""
    if args.model is None:
        on_gpu = args.device != "cpu"
        if on_gpu:
            import torch

            on_gpu = torch.cuda.is_available()
        args.model = GPU_DEFAULT_MODEL if on_gpu else CPU_DEFAULT_MODEL
        print(f"model: {args.model} (pass --model to choose)")
    return args.model


def write_results(args, results: dict[str, Any] | list[dict[str, Any]]) -> None:
    """The run's records to --output-json, and its plots to --plot."""
    write_json(args.output_json, results)
    if getattr(args, "plot", None):
        from inference.bench.plot import write_plots

        for path in write_plots(results if isinstance(results, list) else [results], args.plot):
            print(f"plot: {path}")


def engine_kwargs(args, max_len_needed: int) -> dict[str, Any]:
    """The engine settings given, with the bench's own default for max_model_len: just
    what the workload needs, so that the KV cache is not sized for the model's limit."""
    return config.engine_kwargs(args) | {"max_model_len": args.max_model_len or max_len_needed}


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    # Stay clear of the lowest ids, where special tokens usually live.
    low = 1000 if vocab_size > 4000 else 3
    return rng.integers(low, vocab_size - low, size=(num, length)).tolist()
