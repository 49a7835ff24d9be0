"""Int4 linear (``kernels.int4_linear``): the Triton GEMV and GEMM (interpreter, tiny
shapes) and the float32 reference against the layout's definition in float64, for every
group size (32, 64, 128, per channel), act-order g_idx, K not a multiple of the block, and
batches on both sides of the GEMV/GEMM switch."""

import pytest
import torch

from pagoda_kernels import int4_linear, int4_linear_ref
from pagoda_kernels.int4_linear import ACT_ORDER_GEMV_MAX_M, GEMV_MAX_M

# float32 sums in another order than float64's; bf16: the output's (and, in the GEMM, the
# dequantized weight tile's) rounding.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def layout(n: int, k: int, group_size: int, act_order: bool, seed: int):
    """Random codes, scales and zero points in the kernels' layout, and the float64 weight
    they mean (decoded here with plain integer arithmetic, not the kernels' helpers)."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, groups, generator=gen) + 0.5) / 16 / k**0.5
    zeros = torch.randint(0, 17, (n, groups), generator=gen)  # 16: GPTQ v1's 15 + 1
    padded = torch.zeros(n, -(-k // 8) * 8, dtype=torch.int64)
    padded[:, :k] = codes
    words = sum(padded[:, i::8] << (4 * i) for i in range(8))
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    g_idx = None
    of_input = torch.arange(k) // group_size
    if act_order:  # groups of a desc_act checkpoint: a permutation of k // group_size
        of_input = of_input[torch.randperm(k, generator=gen)]
        g_idx = of_input.to(torch.int32)
    weight = (codes.double() - zeros[:, of_input].double()) * scales[:, of_input].double()
    return (qweight, scales.float().contiguous(), zeros.to(torch.uint8), g_idx), weight


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return ((out.double() - want).norm() / want.norm()).item()


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    from pagoda_kernels._triton import int4_linear as triton_int4

    calls: list[bool] = []
    original = triton_int4.int4_linear

    def spy(*args, gemv):  # type: ignore[no-untyped-def]
        calls.append(gemv)
        return original(*args, gemv=gemv)

    monkeypatch.setattr(triton_int4, "int4_linear", spy)
    return calls


# (N, K, group size): K a multiple of neither block (64) nor, per channel, of 8.
SHAPES = [(40, 160, 32), (33, 192, 64), (24, 384, 128), (40, 100, -1)]


@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
@pytest.mark.parametrize("m", [1, 3, ACT_ORDER_GEMV_MAX_M + 1, GEMV_MAX_M, GEMV_MAX_M + 1, 33])
@pytest.mark.parametrize("act_order", [False, True])
def test_triton_matches_float64(n, k, group_size, m, act_order, triton_calls) -> None:
    if act_order and group_size == -1:
        pytest.skip("one group: nothing to order")
    size = k if group_size == -1 else group_size
    (qweight, scales, zeros, g_idx), weight = layout(n, k, size, act_order, seed=m + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n) if m % 2 else None
    want = x.double() @ weight.T + (0 if bias is None else bias.double())
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        bd = None if bias is None else bias.to(dtype)
        out = int4_linear(xd, qweight, scales, zeros, size, g_idx, bd)
        assert triton_calls[-1] == (m <= (ACT_ORDER_GEMV_MAX_M if act_order else GEMV_MAX_M))
        assert out.dtype == dtype and out.shape == (m, n)
        exact = xd.double() @ weight.T + (0 if bd is None else bd.double())
        assert rel_err(out, exact) < TOLERANCE[dtype], (dtype, rel_err(out, exact))
        ref = int4_linear_ref(xd, qweight, scales, zeros, size, g_idx, bd)
        assert rel_err(ref, exact) < TOLERANCE[dtype]
    assert rel_err(int4_linear_ref(x, qweight, scales, zeros, size, g_idx, bias), want) < 2e-6


@pytest.mark.parametrize("config", [
    dict(block_n=16, block_w=32, split=1, rows=1), dict(block_n=8, block_w=16, split=3, rows=2),
    dict(block_n=16, block_w=16, split=2, rows=4), dict(block_n=32, block_w=64, split=4, rows=4),
])  # fmt: skip
@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
def test_word_gemv_every_launch_shape(n, k, group_size, config) -> None:
    """The word GEMV at explicit launches: K split into slices (some empty past K), row
    blocks with rows past M, tiles past N, per-channel K not a multiple of 8, bias."""
    from pagoda_kernels._triton.int4_linear import WordsConfig, int4_gemv_words, words_eligible

    size = k if group_size == -1 else group_size
    (qweight, scales, zeros, _), weight = layout(n, k, size, False, seed=n + k)
    assert words_eligible(size, scales.shape[1], None)
    for m in (1, 3, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        bias = torch.randn(n) if m != 3 else None
        out = torch.full((m, n), float("nan"))
        int4_gemv_words(x, qweight, scales, zeros, size, bias, out, WordsConfig(**config))
        want = x.double() @ weight.T + (0 if bias is None else bias.double())
        assert rel_err(out, want) < TOLERANCE[torch.float32], (m, config)


# The tensor-core GEMV's paths: K a multiple of the tile or not (384 and 192 of 64/128,
# 100 per channel not of 8), tiles past N, groups of 24 (scale and zero per word).
DOT_SHAPES = [(40, 160, 32), (24, 384, 128), (40, 100, -1), (33, 192, 24)]


@pytest.mark.parametrize("config", [
    dict(block_n=16, block_k=64, split=1, num_stages=2),  # x sums by a dot of ones
    dict(block_n=32, block_k=128, split=3, x_sum="reduce"),
    dict(block_n=64, block_k=32, split=2, scale_after=False),  # every code dequantized
    dict(block_n=16, block_k=256, split=2, num_warps=8, x_sum="dot"),  # lowered to groups
])  # fmt: skip
@pytest.mark.parametrize(("n", "k", "group_size"), DOT_SHAPES)
def test_dot_gemv_matches_float64(n, k, group_size, config) -> None:
    """int4_gemv_dot at explicit launches against the float64 weight: M = 1, 3, 4 (rows
    past M masked), float32 and bf16 (the two-codes-a-word bf16 unpacking), bias or
    none, split 1 or more (slices past K where the split does not divide it)."""
    from pagoda_kernels._triton.int4_linear import DotConfig, int4_gemv_dot, words_eligible

    size = k if group_size == -1 else group_size
    (qweight, scales, zeros, _), weight = layout(n, k, size, False, seed=n + k)
    assert words_eligible(size, scales.shape[1], None)
    for m, dtype in ((1, torch.bfloat16), (3, torch.float32), (3, torch.bfloat16),
                     (4, torch.float32), (4, torch.bfloat16)):  # fmt: skip
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        bias = torch.randn(n).to(dtype) if m != 3 else None
        out = torch.full((m, n), float("nan"), dtype=dtype)
        int4_gemv_dot(x, qweight, scales, zeros, size, bias, out, DotConfig(**config))
        want = x.double() @ weight.T + (0 if bias is None else bias.double())
        assert rel_err(out, want) < TOLERANCE[dtype], (m, dtype, config, rel_err(out, want))


def test_dot_gemv_fp16_and_row_blocks() -> None:
    """fp16 x (1024 + code halves) and M past one 16-row block (a second program row)."""
    from pagoda_kernels._triton.int4_linear import DotConfig, int4_gemv_dot

    (qweight, scales, zeros, _), weight = layout(24, 256, 64, False, seed=3)
    for m, dtype in ((2, torch.float16), (17, torch.float32)):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
        bias = torch.randn(24).to(dtype)
        out = torch.full((m, 24), float("nan"), dtype=dtype)
        int4_gemv_dot(x, qweight, scales, zeros, 64, bias, out, DotConfig(block_n=16, split=2))
        want = x.double() @ weight.T + bias.double()
        assert rel_err(out, want) < (2e-3 if dtype == torch.float16 else 2e-5), (m, dtype)


def test_dot_gemv_refuses_what_it_cannot_run() -> None:
    from pagoda_kernels._triton.int4_linear import DotConfig, int4_gemv_dot

    (qweight, scales, zeros, _), _ = layout(16, 64, 4, False, seed=2)
    x, out = torch.randn(1, 64), torch.empty(1, 16)
    with pytest.raises(ValueError, match="split a word"):
        int4_gemv_dot(x, qweight, scales, zeros, 4, None, out, DotConfig())
    (qweight, scales, zeros, _), _ = layout(16, 64, 32, False, seed=2)
    with pytest.raises(ValueError, match="multiple of 16"):
        int4_gemv_dot(x, qweight, scales, zeros, 32, None, out, DotConfig(block_k=40))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize(("n", "k", "group_size"), SHAPES)
def test_dequantize_into_gives_the_weight(n, k, group_size, act_order) -> None:
    from pagoda_kernels._triton.int4_linear import dequantize_into

    if act_order and group_size == -1:
        pytest.skip("one group: nothing to order")
    size = k if group_size == -1 else group_size
    (qweight, scales, zeros, g_idx), weight = layout(n, k, size, act_order, seed=7)
    # Within one rounding of the dtype (float32: (code - zero) * scale rounds once).
    for dtype, ulp in ((torch.float32, 2.0**-23), (torch.bfloat16, 2.0**-7)):
        out = torch.full((n, k), float("nan"), dtype=dtype)
        dequantize_into(qweight, scales, zeros, size, g_idx, k, out)
        assert ((out.double() - weight).abs() <= ulp * weight.abs()).all(), dtype


def test_scratch_path_dequantizes_then_multiplies(triton_calls) -> None:
    """Above GEMV_MAX_M rows with a scratch buffer: dequantized into it, then a plain matmul
    (no Triton GEMM call), bias added, into ``out``."""
    (qweight, scales, zeros, g_idx), weight = layout(24, 384, 128, True, seed=4)
    x = torch.randn(GEMV_MAX_M + 3, 384)
    bias = torch.randn(24)
    scratch = torch.full((24 * 384 + 5,), float("nan"))
    out = torch.empty(GEMV_MAX_M + 3, 24)
    result = int4_linear(x, qweight, scales, zeros, 128, g_idx, bias, out, scratch)
    assert result.data_ptr() == out.data_ptr() and triton_calls == []
    assert rel_err(out, x.double() @ weight.T + bias.double()) < 2e-5


def test_out_buffer_and_leading_dims(triton_calls) -> None:
    (qweight, scales, zeros, g_idx), weight = layout(16, 64, 32, False, seed=1)
    x = torch.randn(2, 2, 64)  # GEMV_MAX_M rows
    out = torch.empty(2, 2, 16)
    result = int4_linear(x, qweight, scales, zeros, 32, out=out)
    assert result.data_ptr() == out.data_ptr() and triton_calls == [True]
    assert rel_err(out.reshape(4, 16), x.reshape(4, 64).double() @ weight.T) < 2e-5


def test_bad_layouts_are_refused() -> None:
    (qweight, scales, zeros, _), _ = layout(16, 64, 32, False, seed=2)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="qweight must be int32"):
        int4_linear(x, qweight[:, :4].contiguous(), scales, zeros, 32)
    with pytest.raises(ValueError, match="group_size 16 needs more"):
        int4_linear(x, qweight, scales, zeros, 16)
    with pytest.raises(ValueError, match="g_idx must be int32"):
        int4_linear(x, qweight, scales, zeros, 32, torch.zeros(64, dtype=torch.int64))


# Compiled, not interpreted, for an H200 (sm_90, Triton's bundled ptxas): the interpreter
# accepts code the compiler refuses. bf16 activations, with and without g_idx.
AOT_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagoda_kernels._triton import int4_linear as k

ARGS = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "scales_ptr": "*fp32", "zeros_ptr": "*u8",
        "g_idx_ptr": "*i32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
        "ws_ptr": "*fp32",
        **{i: "i32" for i in ("M", "N", "K", "stride_x", "stride_q", "stride_o", "num_groups",
                              "words_per_split", "magic")}}

def build(kernel, consts):
    types = {a: t for a, t in ARGS.items() if a in kernel.arg_names}
    signature = {**types, **{c: "constexpr" for c in consts}}
    constexprs = {(kernel.arg_names.index(c),): v for c, v in consts.items()}
    src = ASTSource(kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 2})

for g_idx in (False, True):
    flags = dict(GROUP_SIZE=128, HAS_G_IDX=g_idx, HAS_BIAS=not g_idx)
    build(k._int4_gemv_kernel, flags | dict(BLOCK_N=32, BLOCK_K=64))
    gemm = build(k._int4_gemm_kernel, flags | dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64,
                                                   PRECISION="tf32"))
    assert "mma" in gemm.asm["ptx"], "the GEMM must run on the tensor cores"
for rows in (1, 4):
    build(k._int4_gemv_words_kernel, dict(GROUP_SIZE=128, ROWS=rows, BLOCK_N=16, BLOCK_W=32,
                                          USE_WS=rows == 4, HAS_BIAS=rows == 1))
for tile, x_sum_dot in ((True, True), (True, False), (False, False)):
    dot = build(k._int4_gemv_dot_kernel, dict(
        GROUP_SIZE=128 if tile else 24, TILE_META=tile, SCALE_AFTER=tile, X_SUM_DOT=x_sum_dot,
        CODE_BASE=128, BLOCK_N=64, BLOCK_K=128 if tile else 64, M_PAD=16, EVEN_K=x_sum_dot,
        USE_WS=tile, HAS_BIAS=not tile, PRECISION="tf32"))
    assert "wgmma" in dot.asm["ptx"], "the dot GEMV must run on Hopper's wgmma"
print("compiled")
"""


def test_kernels_compile_for_hopper() -> None:
    from hopper_compile import run_compile_script

    done = run_compile_script(AOT_SCRIPT)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_one_row_launches_follow_the_h200_sweep() -> None:
    """At one row the tensor-core GEMV takes the 7B's wide and square projections, the
    word GEMV long K and the 1.5B's (int4_check_dot_h200.json); every launch has a config."""
    from pagoda_kernels._triton.int4_linear import dot_config_for, dot_wins_at_one_row

    assert dot_wins_at_one_row(37888, 3584) and dot_wins_at_one_row(3584, 3584)
    assert dot_wins_at_one_row(4608, 3584)
    for n, k in ((3584, 18944), (17920, 1536), (2048, 1536), (1536, 8960)):
        assert not dot_wins_at_one_row(n, k)
    assert dot_config_for(37888, 3584).block_k == 64  # wide: 64 x 64 tiles, K in halves
    assert dot_config_for(3584, 18944).num_warps == 8  # long K: 128 x 128 tiles
    assert dot_config_for(1536, 8960).split == 8
