"""Which Triton GEMV config runs a small-M linear on the GPU, or None for cuBLAS.

Plain Python (no Triton import), so ``kernels.linear`` can decide without loading Triton.
``FP8_TABLE``/``lookup_fp8`` do the same for the FP8 skinny GEMM (``kernels.fp8_linear``),
filled from ``python -m benchmarks.gemv_check --fp8`` (``fp8_table_from_sweep``).
``TABLE`` holds the shapes measured on one H200 with ``benchmarks/gemv_check.py``
(bf16, CUDA-graph replay, weights rotated past L2); ``heuristic`` covers the interpreter
and the sweep's starting points.
"""

from dataclasses import dataclass

FMA_MAX_M = 8  # the fma kernel keeps one accumulator per token row, 8 at most


@dataclass(frozen=True)
class GemvConfig:
    # "fma" (elementwise FMAs, M <= 8) or "dot" (tl.dot, M padded to 16); FP8 adds "fmaq"
    # and "dotq": the same with the activations quantized by a separate launch first.
    kind: str
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1

    def short(self) -> str:
        return (
            f"{self.kind}:n{self.block_n}k{self.block_k}s{self.split_k}"
            f"w{self.num_warps}st{self.num_stages}"
        )


def _next_pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def heuristic(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """A reasonable config for any shape: enough programs in flight (>= 4 per SM) from
    narrow row blocks first, split-K only when even one-row blocks are too few."""
    if m <= FMA_MAX_M:
        block_k = max(16, min(1024 if m <= 2 else 512, _next_pow2(k)))
        target = 4 * num_sms
        block_n = 8
        while block_n > 1 and -(-n // block_n) < target:
            block_n //= 2
        programs = -(-n // block_n)
        split = 1
        while programs * split < 2 * num_sms and split * 2 * block_k <= k:
            split *= 2
        return GemvConfig("fma", block_n, block_k, split, num_warps=4)
    block_k = max(16, min(128, _next_pow2(k)))
    block_n = 64 if n >= 64 * 2 * num_sms else 16
    programs = -(-n // block_n)
    split = 1
    while programs * split < 2 * num_sms and split * 2 * block_k <= k:
        split *= 2
    return GemvConfig("dot", block_n, block_k, split, num_warps=4, num_stages=3)


def _fma(block_n: int, block_k: int, num_warps: int) -> GemvConfig:
    return GemvConfig("fma", block_n, block_k, 1, num_warps)


def _dot(block_n: int, block_k: int, split_k: int, num_stages: int) -> GemvConfig:
    return GemvConfig("dot", block_n, block_k, split_k, 4, num_stages)


# (N, K) -> [(largest M, config or None = cuBLAS)], M ascending; M past the last entry
# goes to cuBLAS. Each entry is the sweep's fastest config where it beat cuBLAS by > 3%
# (H200, bf16, CUDA-graph replay, weights rotated over 300 MB; us cuBLAS -> Triton).
TABLE: dict[tuple[int, int], list[tuple[int, GemvConfig | None]]] = {
    # Qwen2.5-1.5B
    (2048, 1536): [(1, _fma(1, 2048, 4)), (2, _fma(2, 512, 4)), (4, _fma(8, 512, 8))],  # qkv: M1 5.4->3.6; M2 5.8->4.2; M4 5.8->5.1
    (1536, 1536): [(1, _fma(2, 2048, 8)), (2, _fma(2, 2048, 4)), (4, _fma(4, 512, 4))],  # o: M1 6.5->3.1; M2 6.3->3.7; M4 6.3->4.5
    (17920, 1536): [(1, _fma(4, 256, 4)), (2, _fma(8, 512, 4)), (8, None), (16, _dot(64, 128, 1, 3))],  # gate_up: M1 16.8->14.6; M2 16.8->15.7; M16 17.4->15.6
    (1536, 8960): [(1, _fma(1, 2048, 4)), (2, _fma(2, 1024, 8))],  # down: M1 11.3->8.6; M2 11.3->9.5
    # Qwen2.5-7B
    (4608, 3584): [(1, _fma(4, 256, 4)), (2, _fma(4, 512, 4))],  # qkv: M1 11.4->9.7; M2 11.2->10.2
    (3584, 3584): [(1, _fma(4, 512, 8)), (2, _fma(4, 512, 4)), (4, _fma(4, 512, 4))],  # o: M1 10.7->7.9; M2 10.7->8.7; M4 10.7->10.2
    (37888, 3584): [(1, _fma(1, 2048, 4)), (2, _fma(8, 256, 4)), (8, _dot(64, 256, 1, 4)), (16, _dot(64, 128, 1, 3))],  # gate_up: M1 69.1->60.6; M2 71.5->61.8; M4 70.0->65.8; M8 71.8->65.8; M16 71.0->63.9
    (3584, 18944): [(1, _fma(4, 512, 8)), (2, _fma(2, 512, 4))],  # down: M1 36.2->32.1; M2 37.2->34.9
    # Qwen2.5-7B, one rank's shards at tensor_parallel_size=2 (gemv_sweep_7b_tp2_h200.json)
    (2304, 3584): [(1, _fma(2, 512, 4)), (2, _fma(2, 512, 4))],  # qkv: M1 8.7->6.2; M2 8.9->7.2
    (3584, 1792): [(1, _fma(2, 1024, 4)), (2, _fma(4, 512, 8))],  # o: M1 6.2->5.0; M2 6.3->6.1
    (18944, 3584): [(1, _fma(1, 2048, 4)), (2, _fma(8, 512, 4))],  # gate_up: M1 36.2->31.8; M2 36.4->33.4
    (3584, 9472): [(1, _fma(2, 1024, 4)), (2, _fma(4, 512, 8))],  # down: M1 20.1->17.8; M2 20.1->19.5
    # Llama-3-8B
    (6144, 4096): [(1, _fma(1, 2048, 8)), (2, _fma(4, 512, 4))],  # qkv: M1 16.1->13.0; M2 15.8->14.2
    (4096, 4096): [(1, _fma(1, 2048, 8)), (2, _fma(4, 1024, 4))],  # o: M1 12.5->9.4; M2 12.4->10.3
    (28672, 4096): [(1, _fma(1, 2048, 8))],  # gate_up: M1 55.2->52.4
    (4096, 14336): [(1, _fma(1, 2048, 4)), (2, _fma(4, 1024, 4))],  # down: M1 30.2->27.6; M2 30.3->28.6
}  # fmt: skip

# Shapes not in TABLE at M = 1: fma, one row a program, 2048-wide K tiles. In the sweep it
# beat cuBLAS on all 12 projections (by 4-50%) and was within 10% of each one's best; used
# only inside the measured size range (LM heads, 467 MB+, stay on cuBLAS: it is at
# bandwidth there and this config lost 24% on the 1.5B head).
GENERIC_M1 = _fma(1, 2048, 4)
GENERIC_RANGE = {"n": (1024, 40000), "k": (1024, 20000), "bytes": 300 * 2**20}


def lookup(m: int, n: int, k: int, element_size: int = 2) -> GemvConfig | None:
    entries = TABLE.get((n, k))
    if entries is not None:
        for max_m, config in entries:
            if m <= max_m:
                return config
        return None
    low_n, high_n = GENERIC_RANGE["n"]
    low_k, high_k = GENERIC_RANGE["k"]
    if (
        m == 1
        and low_n <= n <= high_n
        and low_k <= k <= high_k
        and n * k * element_size <= GENERIC_RANGE["bytes"]
    ):
        return GENERIC_M1
    return None


# (2I, K) of a gate_up weight -> [(largest M, fma config)] for the fused gate_up +
# SiLU-and-mul kernel (block_n counts output columns: 2 x block_n weight rows). Where it
# beat gate_up + silu_and_mul (either GEMM) by > 3%; us are fused vs cuBLAS + silu_and_mul.
GATED_TABLE: dict[tuple[int, int], list[tuple[int, GemvConfig | None]]] = {
    (17920, 1536): [(1, _fma(8, 256, 4)), (2, _fma(8, 256, 4))],  # 1.5B: M1 17.8->14.4; M2 18.4->15.0
    (37888, 3584): [(1, _fma(2, 512, 4)), (2, _fma(8, 256, 4)), (4, _fma(8, 256, 4))],  # 7B: M1 72.0->60.9; M2 71.7->62.1; M4 71.8->67.0
    (28672, 4096): [(1, _fma(1, 2048, 8))],  # 8B: M1 61.1->52.9 (M2: 56.5->55.6, < 3%)
    (18944, 3584): [(1, _fma(8, 256, 4)), (2, _fma(8, 256, 4))],  # 7B TP2: M1 37.6->32.1; M2 37.8->32.6
}  # fmt: skip


def lookup_gated(m: int, n2: int, k: int) -> GemvConfig | None:
    for max_m, config in GATED_TABLE.get((n2, k), ()):
        if m <= max_m:
            return config
    return None


# FP8 skinny GEMM (``pagoda_kernels/_triton/fp8_linear.py``): (N, K) -> [(largest M, config or
# None = cuBLASLt's ``_scaled_mm``)], M ascending, as TABLE; M past the last entry of a
# listed shape, and shapes not listed, take ``fp8_heuristic``. Filled from an H200 sweep
# (``gemv_check --fp8``): paste ``table_source(fp8_table_from_sweep(json))`` here.
# Measured on one H200 at 23746ab (results/fp8_sweep_h200.json); a decoder layer's four
# projections at M = 1, us bf16 -> FP8: 7B 111.6 -> 74.4, 1.5B 30.2 -> 27.6.
FP8_TABLE: dict[tuple[int, int], list[tuple[int, GemvConfig | None]]] = {
    (1536, 1536): [
        (1, GemvConfig(kind='fma', block_n=2, block_k=1024, split_k=1, num_warps=4, num_stages=1)),
        (2, GemvConfig(kind='fmaq', block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1)),
        (4, GemvConfig(kind='fmaq', block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1)),
        (8, GemvConfig(kind='fmaq', block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1)),
    ],
    (1536, 8960): [
        (1, GemvConfig(kind='fmaq', block_n=1, block_k=2048, split_k=1, num_warps=4, num_stages=1)),
        (2, GemvConfig(kind='fmaq', block_n=1, block_k=2048, split_k=1, num_warps=4, num_stages=1)),
        (4, GemvConfig(kind='dotq', block_n=64, block_k=256, split_k=16, num_warps=4, num_stages=3)),
        (8, GemvConfig(kind='dotq', block_n=64, block_k=256, split_k=16, num_warps=4, num_stages=3)),
    ],
    (2048, 1536): [
        (1, GemvConfig(kind='fma', block_n=8, block_k=1024, split_k=1, num_warps=8, num_stages=1)),
        (2, GemvConfig(kind='fmaq', block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1)),
        (4, GemvConfig(kind='fmaq', block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1)),
        (8, GemvConfig(kind='fmaq', block_n=4, block_k=512, split_k=1, num_warps=2, num_stages=1)),
    ],
    (3584, 3584): [
        (1, GemvConfig(kind='fma', block_n=8, block_k=1024, split_k=1, num_warps=8, num_stages=1)),
        (2, GemvConfig(kind='fmaq', block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1)),
        (4, GemvConfig(kind='dotq', block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=4)),
        (8, GemvConfig(kind='dotq', block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=4)),
    ],
    (3584, 18944): [
        (1, GemvConfig(kind='fmaq', block_n=2, block_k=1024, split_k=1, num_warps=4, num_stages=1)),
        (2, GemvConfig(kind='dotq', block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=4)),
        (4, GemvConfig(kind='dotq', block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=4)),
        (8, GemvConfig(kind='dotq', block_n=64, block_k=128, split_k=8, num_warps=4, num_stages=4)),
    ],
    (4608, 3584): [
        (1, GemvConfig(kind='fma', block_n=8, block_k=1024, split_k=1, num_warps=8, num_stages=1)),
        (2, GemvConfig(kind='fmaq', block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1)),
        (4, GemvConfig(kind='dotq', block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4)),
        (8, GemvConfig(kind='dotq', block_n=64, block_k=128, split_k=4, num_warps=4, num_stages=4)),
    ],
    (17920, 1536): [
        (1, GemvConfig(kind='fma', block_n=8, block_k=512, split_k=1, num_warps=4, num_stages=1)),
        (2, GemvConfig(kind='dotq', block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3)),
        (4, GemvConfig(kind='dotq', block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3)),
        (8, GemvConfig(kind='dotq', block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3)),
    ],
    (37888, 3584): [
        (1, GemvConfig(kind='fmaq', block_n=4, block_k=512, split_k=1, num_warps=2, num_stages=1)),
        (2, GemvConfig(kind='dotq', block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3)),
        (4, GemvConfig(kind='dotq', block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3)),
        (8, GemvConfig(kind='dotq', block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3)),
    ],
}  # fmt: skip


def fp8_heuristic(m: int, n: int, k: int, num_sms: int, tensor_cores: bool = True) -> GemvConfig:
    """An FP8 config for any M <= FMA_MAX_M. M = 1: the fma kernel (activations quantized
    in the kernel, no extra launch) over 16-element (16-byte) fp8 runs, 4 rows a program,
    >= 4 programs per SM before split-K. M >= 2: the fma kernel's conversions and FMAs grow
    with M (ALU-bound on an H200), so the swap-AB tensor-core kernel (64 weight rows a
    program; >= 2 programs per SM before split-K). ``tensor_cores=False``: the fma kernel
    at every M (float32 accumulation of every product)."""
    if m == 1 or not tensor_cores:
        block_k = max(16, min(512, _next_pow2(k)))
        block_n = 4
        while block_n > 1 and -(-n // block_n) < 4 * num_sms:
            block_n //= 2
        kind, target, warps, stages = "fma", 2 * num_sms, 4, 1
    else:
        block_k = max(16, min(256, _next_pow2(k)))
        block_n = 64
        kind, target, warps, stages = "dot", 2 * num_sms, 4, 3
    split = 1
    while -(-n // block_n) * split < target and split * 2 * block_k <= k:
        split *= 2
    return GemvConfig(kind, block_n, block_k, split, warps, stages)


def lookup_fp8(m: int, n: int, k: int, num_sms: int,
               tensor_cores: bool = True) -> GemvConfig | None:  # fmt: skip
    """The FP8 config for M <= FMA_MAX_M (None: ``_scaled_mm`` measured faster).
    ``tensor_cores=False`` (float32 activations) keeps to the fma kinds: Hopper's FP8 MMA
    sums a K tile's products in reduced precision, fine under bf16's rounding but not the
    float32 scheme's."""
    for max_m, config in FP8_TABLE.get((n, k), ()):
        if m <= max_m:
            if config is None or tensor_cores or config.kind in ("fma", "fmaq"):
                return config
            break
    return fp8_heuristic(m, n, k, num_sms, tensor_cores)


Fp8Table = dict[tuple[int, int], list[tuple[int, GemvConfig | None]]]


def fp8_table_from_sweep(sweep: dict) -> Fp8Table:
    """A ``gemv_check --fp8`` JSON's ``fp8_table`` ("N,K" -> [[M, config fields or None]])
    as FP8_TABLE entries; a measured M covers the M up to it (M sorted)."""
    table: Fp8Table = {}
    for key, entries in sweep["fp8_table"].items():
        n, k = (int(v) for v in key.split(","))
        rows = [(int(m), GemvConfig(**fields) if fields else None) for m, fields in entries]
        table[(n, k)] = sorted(rows, key=lambda e: e[0])
    return table


def table_source(table: Fp8Table) -> str:
    """Python source of a table's entries, one shape a line (to paste into FP8_TABLE)."""
    lines = []
    for (n, k), entries in sorted(table.items()):
        items = ", ".join(f"({m}, {config!r})" for m, config in entries)
        lines.append(f"    ({n}, {k}): [{items}],")
    return "\n".join(lines)
