"""``pagoda``: serve a model, benchmark it, or ask it one question.

  pagoda serve [MODEL] [--port 8000 ...]     OpenAI-compatible server (vLLM flag names)
  pagoda router --backend [MODEL=]URL ...    one endpoint for many engines, prefix-aware
  pagoda bench throughput|latency|serve ...  the numbers people quote
  pagoda chat "question" [--model MODEL]     one answer through the offline API
  pagoda download URI DIR                    weights from hf://, s3:// or a folder into DIR
                                             (--lora-max-rank R: and check a LoRA adapter)
  pagoda convert-default-model               prepare the embedded SmolLM2 folder
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _chat(args: argparse.Namespace) -> int:
    from inference import LLM, SamplingParams
    from inference.config import engine_kwargs

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    out = llm.chat([{"role": "user", "content": args.question}], params, use_tqdm=False)[0]
    print(f"> {args.question}\n{out.outputs[0].text.strip()}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from inference.model_files import ensure_default_model

    print(ensure_default_model(force=args.force))
    return 0


def _download(args: argparse.Namespace) -> int:
    """``pagoda download``; with ``--lora-max-rank``, the folder must then be a LoRA adapter
    the engine serves at that rank (else exit 6, as a failed verification: a Job's pod
    failure policy stops at once, and the operator reports it before any engine rolls)."""
    from inference.download import run_download

    code = run_download(args)
    if code != 0 or args.lora_max_rank is None:
        return code
    from inference.download.common import IntegrityError
    from inference.lora.peft import AdapterError, check_adapter_files

    try:
        check_adapter_files(args.dest, args.lora_max_rank)
    except AdapterError as error:
        logging.getLogger("inference.download").error("%s: %s", args.uri, error)
        if args.result_file:
            result = {"error": "InvalidAdapter", "message": f"{args.uri}: {error}"[:3000]}
            Path(args.result_file).write_text(json.dumps(result, sort_keys=True))
        return IntegrityError.exit_code
    return 0


def build_parser() -> argparse.ArgumentParser:
    from inference.bench.latency import add_latency_args, run_latency
    from inference.bench.serve import add_bench_serve_args, run_bench_serve
    from inference.bench.throughput import add_throughput_args, run_throughput
    from inference.config import add_engine_args
    from inference.download import add_download_args
    from inference.router.cli import add_router_args, run_router
    from inference.server.cli_serve import add_serve_args, run_serve

    parser = argparse.ArgumentParser(prog="pagoda", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    serve.set_defaults(func=run_serve)

    router = sub.add_parser("router", help="OpenAI-compatible router in front of engines")
    add_router_args(router).set_defaults(func=run_router)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    add_throughput_args(bench.add_parser("throughput", help="offline output tok/s")).set_defaults(
        func=run_throughput
    )
    add_latency_args(bench.add_parser("latency", help="batch latency, TTFT, TPOT")).set_defaults(
        func=run_latency
    )
    add_bench_serve_args(
        bench.add_parser("serve", help="load an OpenAI-compatible server")
    ).set_defaults(func=run_bench_serve)

    chat = sub.add_parser("chat", help="answer one question with the offline API")
    chat.add_argument("question", nargs="?", default="What is the capital of France?")
    chat.add_argument("--model", default="default")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0)
    add_engine_args(chat, exclude=("served_model_name",))
    chat.set_defaults(max_model_len=2048)  # one short answer: a small KV cache starts fast
    chat.set_defaults(func=_chat)

    download = add_download_args(
        sub.add_parser("download", help="fetch model weights into a folder (resumable, verified)")
    )
    download.add_argument(
        "--lora-max-rank", type=int, default=None, metavar="RANK",
        help="the folder is a LoRA adapter: check it is one the engine serves at this "
        "--max-lora-rank (config and tensor names; exit 6 if not)",
    )  # fmt: skip
    download.set_defaults(func=_download)

    convert = sub.add_parser("convert-default-model", help="prepare the embedded model folder")
    convert.add_argument("--force", action="store_true")
    convert.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    from inference.server.vllm_flags import normalize_flag_spelling

    args = build_parser().parse_args(
        normalize_flag_spelling(sys.argv[1:] if argv is None else argv)
    )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # bad user input: a message, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
