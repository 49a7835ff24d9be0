"""Where a decode step's time goes: torch.profiler over a short generation, kernels ranked
by GPU time, plus the GPU-busy fraction of the wall time. Before it, a run of its own
times each part of a step with CUDA events around it (the GPU time from the first to the
last work it queued, any wait for the host in between included): the target's steps and,
with speculative decoding, its verify steps and a draft model's round, catch-up forward and
later forwards; a round's wall time beside them shows what the host adds.

    python -m benchmarks.profile_decode --model qwen2.5-1.5b --batch-size 1

The engine flags and workloads of ``pagoda bench latency`` apply; the draft-model row of
issue #24 (the 7B copying a 2k-token document, a 0.5B-shaped draft missing 14 % of it):

    python -m benchmarks.profile_decode --model qwen2.5-7b --workload copy --copy-model \
        --draft-copy-miss-rate 0.14 --output-len 128 --speculative-config \
        '{"method": "draft_model", "model": "qwen2.5-0.5b", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

from inference import config
from inference.bench.common import (
    add_workload_args,
    bench_model,
    copy_model_folder,
    engine_kwargs,
    install_copy_model,
    spec_decode_counts,
    spec_decode_line,
    spec_decode_summary,
    workload_input_len,
    workload_prompts,
)
from inference.model_shapes import resolve_shape_model


class Spans:
    """Device time of calls, by name: CUDA events around each call on a GPU (read once the
    run is over), the host clock on CPU (where the work runs in the call)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.spans: dict[str, list] = collections.defaultdict(list)
        self.wrapped: list[tuple[object, str]] = []

    def mark(self):
        import torch

        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap(self, obj, attr: str, name) -> None:
        """Time ``obj.attr``; ``name(*args)`` names each call (None: not timed)."""
        call = getattr(obj, attr)

        def timed(*args, **kwargs):
            start = self.mark()
            out = call(*args, **kwargs)
            label = name(*args)
            if label is not None:
                self.spans[label].append((start, self.mark()))
            return out

        setattr(obj, attr, timed)
        self.wrapped.append((obj, attr))

    def unwrap(self) -> None:
        for obj, attr in self.wrapped:
            delattr(obj, attr)  # the class's method again

    def milliseconds(self) -> dict[str, list[float]]:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return {k: [s.elapsed_time(e) for s, e in v] for k, v in self.spans.items()}
        return {k: [(e - s) * 1e3 for s, e in v] for k, v in self.spans.items()}


def time_parts(engine, cuda: bool) -> Spans:
    """Wraps the target's step launch and a draft model's round and forwards."""
    spans = Spans(cuda)
    spans.wrap(engine.runner, "launch", lambda seqs, counts, rows, sampling: (
        "target step" if sampling.draft_token_ids is None else "target verify step"))
    draft = getattr(getattr(engine, "spec_decoder", None), "draft", None)
    if draft is not None and hasattr(draft, "_forward"):  # a draft model
        forwards = [0]

        def round_name(seqs):
            forwards[0] = 0
            return "draft round" if any(s.draft_token_ids for s in seqs) else None

        def forward_name(seqs, chunks, *_):  # (main before 6cea824 passes a fourth)
            forwards[0] += 1
            kind = "draft catch-up" if forwards[0] == 1 else "draft forward"
            return f"{kind}, {'decode' if max(map(len, chunks)) == 1 else 'mixed'} step"

        spans.wrap(draft, "_forward", forward_name)
        spans.wrap(draft, "propose", round_name)
    return spans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="profile_decode")
    parser.add_argument("--model", default=None, help="a folder or a named shape")
    config.add_engine_args(parser, exclude=("served_model_name",))
    add_workload_args(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from inference import LLM, SamplingParams

    folder, extra = resolve_shape_model(bench_model(args))
    copy_model_folder(args, folder, extra)
    kwargs = engine_kwargs(args, workload_input_len(args) + args.output_len)
    if args.max_num_seqs is None:
        kwargs["max_num_seqs"] = max(args.batch_size, 8)
    llm = LLM(folder, **(extra | kwargs))
    engine = llm.engine
    install_copy_model(args, engine)
    cuda = engine.config.device == "cuda"
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len,
                            detokenize=False)

    def generate(seed: int) -> float:
        prompts = workload_prompts(args, engine, args.batch_size, args.input_len, seed)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(1)  # warm-up
    spec_before = spec_decode_counts(engine)
    spans = time_parts(engine, cuda)
    wall = generate(2)
    print(f"{args.model} batch {args.batch_size}: {args.output_len} tokens in "
          f"{wall * 1e3:.1f} ms ({wall / args.output_len * 1e3:.3f} ms/token), parts timed")
    summary = spec_decode_summary(engine, spec_before)
    if summary:
        print(spec_decode_line(summary))
    print(f"{'ms mean':>8} {'median':>8} {'calls':>6}  part (device time per call)")
    parts = spans.milliseconds()
    for name, ms in sorted(parts.items()):
        print(f"{statistics.mean(ms):8.3f} {statistics.median(ms):8.3f} {len(ms):6d}  {name}")
    if "target verify step" in parts:
        rounds = len(parts["target verify step"])
        print(f"{wall / rounds * 1e3:8.3f} {'':8} {rounds:6d}  wall per verify step (the "
              "prefill included)")
    spans.unwrap()  # the profiled run pays no event records

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        wall = generate(3)
    if not cuda:
        return 0
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    gpu_total_us = sum(e.self_device_time_total for e in events)
    print(f"{args.model} batch {args.batch_size}: {args.output_len} tokens in "
          f"{wall * 1e3:.1f} ms ({wall / args.output_len * 1e3:.3f} ms/token), profiled; "
          f"GPU busy {gpu_total_us / 1e3:.1f} ms ({gpu_total_us / 1e6 / wall:.0%} of wall)")
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print(f"{'GPU us':>10} {'calls':>7} {'us/call':>8}  kernel")
    for e in events[: args.top]:
        per_call = e.self_device_time_total / max(e.count, 1)
        print(f"{e.self_device_time_total:10.0f} {e.count:7d} {per_call:8.1f}  {e.key[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
