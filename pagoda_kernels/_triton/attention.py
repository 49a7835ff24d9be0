"""Triton paged attention: one kernel for prefill, chunked prefill and decode.

A program owns a *query block*: ``BLOCK_Q`` consecutive query tokens of one sequence times
the ``GROUP`` query heads that share one KV head (GQA), flattened into ``BLOCK_M`` rows so
that one ``tl.dot`` serves the whole group and every K/V tile is read once per group. A
group that is not a power of two pads its rows (6 heads in 8 rows: a quarter of every MMA
is padding), so long prefills may instead take ``BLOCK_M`` tokens of one query head a
program (``Tiling.per_head``, as FlashAttention does): no padding, and the group's K/V
tiles read once per head, mostly from L2. It walks the sequence's KV tiles through the block table with an online softmax (flash
attention), stopping at the block's causal limit.

Query blocks are numbered without a host sync: sequence ``b`` owns blocks starting at
``query_start_loc[b] // BLOCK_Q + b``, so ``T // BLOCK_Q + B`` programs always suffice
and each program finds its sequence by binary search; surplus programs exit at once.

When there are too few programs to fill the GPU (decode at small batch, short chunks over
long context) the KV range is split into ``NUM_SEGMENTS`` segments (flash-decoding):
each segment writes an unnormalised partial result with its running max and sum, and a
second kernel merges them. The split count depends only on shapes, so a launch is the
same for every step of a CUDA graph.

An FP8 cache (``KV_FP8``) is loaded as e4m3 (half the bytes of bf16), widened to the
query's dtype (exact: every e4m3 value is a bf16/fp16/fp32 value) for the same ``tl.dot``
as a bf16 cache; the key scale is folded into the softmax scale and the value scale into
the result (each is one multiply per row instead of one per element). Both scales are
read from device memory, so a CUDA graph replays with whatever they hold.
"""

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagoda_kernels._backend import num_sms
from pagoda_kernels._triton.kv_cache import scale_args
from pagoda_kernels._triton.pdl import launch_pdl, wait_for_inputs

# Partial results of the split path are float32 [T, Hq, segments, D]; past this size the
# split costs more traffic than the occupancy it buys.
_MAX_PARTIAL_BYTES = 256 * 1024 * 1024
_MAX_SEGMENTS = 64
# Large prefill tiles (``_large_query_tiles``) one query head a program (``Tiling.per_head``).
_PER_HEAD_LARGE_TILES = False


@triton.jit
def _first_block(query_start, seq, BLOCK_Q: tl.constexpr):
    if BLOCK_Q == 1:
        return query_start
    else:
        return query_start // BLOCK_Q + seq


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Last sequence whose first query block is <= q_block (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = _first_block(tl.load(query_start_loc_ptr + mid), mid, BLOCK_Q)
        go_right = first <= q_block
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, tile_start, kv_hi, q_pos, offs_n, dims, dim_valid,
    block_table_row, k_head_ptr, v_head_ptr, qk_scale,
    stride_kb, stride_ks, stride_vb, stride_vs,
    BLOCK_SIZE: tl.constexpr, FP32_DOT: tl.constexpr, KV_FP8: tl.constexpr,
    HEAD_MASKED: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One KV tile of the online softmax. ``MASKED``: the tile may hold keys past the
    segment's end or past a row's causal limit; otherwise every row sees every key."""
    key_pos = tile_start + offs_n
    # One block-id load per key keeps every block size (1..256) on one code path;
    # for blocks >= TILE_N the loads hit the same address and cost nothing extra.
    if MASKED:
        key_valid = key_pos < kv_hi
        block = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
    else:
        block = tl.load(block_table_row + key_pos // BLOCK_SIZE)
    block = block.to(tl.int64)
    in_block = key_pos % BLOCK_SIZE
    k_rows = block * stride_kb + in_block * stride_ks
    v_rows = block * stride_vb + in_block * stride_vs
    if MASKED:
        k = tl.load(k_head_ptr + k_rows[None, :] + dims[:, None],
                    mask=key_valid[None, :] & dim_valid[:, None], other=0.0)  # fmt: skip
    elif HEAD_MASKED:
        k = tl.load(k_head_ptr + k_rows[None, :] + dims[:, None],
                    mask=dim_valid[:, None], other=0.0)  # fmt: skip
    else:
        k = tl.load(k_head_ptr + k_rows[None, :] + dims[:, None])
    if KV_FP8:
        k = k.to(tl.float32).to(q.dtype)
    if FP32_DOT:
        scores = tl.dot(q, k, input_precision="ieee")
    else:
        scores = tl.dot(q, k)
    scores = scores * qk_scale
    if MASKED:
        visible = key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # Rows with nothing visible yet keep m = -inf; shift them by 0 to avoid inf - inf.
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every key is visible
        m_shift = m_new
    p = tl.math.exp2(scores - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_head_ptr + v_rows[:, None] + dims[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # fmt: skip
    elif HEAD_MASKED:
        v = tl.load(v_head_ptr + v_rows[:, None] + dims[None, :],
                    mask=dim_valid[None, :], other=0.0)  # fmt: skip
    else:
        v = tl.load(v_head_ptr + v_rows[:, None] + dims[None, :])
    if KV_FP8:
        v = v.to(tl.float32).to(q.dtype)
    if FP32_DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


# Integers that change from step to step are not specialised on (Triton would otherwise
# compile a variant for 1, for multiples of 16 and for the rest, mid-serving).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, k_scale_ptr, v_scale_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, FP32_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    q_block = tl.program_id(0)
    head_block = tl.program_id(1)  # HEADS query heads: a KV head's group, or one head
    kv_head = head_block * HEADS // GROUP
    segment = tl.program_id(2)

    if BLOCK_Q == 1:
        # Decode batches map token i to sequence i: check that guess with two loads that
        # issue together before paying for a binary search of dependent loads.
        guess = tl.minimum(q_block, num_seqs - 1)
        guess_start = tl.load(query_start_loc_ptr + guess)
        guess_end = tl.load(query_start_loc_ptr + guess + 1)
        if (guess_start <= q_block) & (q_block < guess_end):
            seq = guess
        else:
            seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - _first_block(q_start, seq, BLOCK_Q)
    if local_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_local = local_block * BLOCK_Q + rows // HEADS_PAD
    head_in_block = rows % HEADS_PAD
    head = head_block * HEADS + head_in_block
    row_valid = (rows // HEADS_PAD < BLOCK_Q) & (q_local < q_len) & (head_in_block < HEADS)
    q_pos = context_len - q_len + q_local
    token = (q_start + q_local).to(tl.int64)
    dims = tl.arange(0, HEAD_PAD)
    # A mask along the head dim, even an all-true one, stops the compiler from proving
    # 16-byte runs and turns every K/V load into 2-byte loads that cannot be pipelined:
    # only padded head sizes get one.
    if HEAD_PAD == HEAD_SIZE:
        dim_valid = tl.full([HEAD_PAD], 1, tl.int1)
    else:
        dim_valid = dims < HEAD_SIZE

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # Keys this block may see: up to its last query's position (causal), clipped to the
    # segment this program owns when the KV range is split.
    last_q_local = tl.minimum(local_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = tl.minimum(context_len, context_len - q_len + last_q_local + 1)
    if NUM_SEGMENTS == 1:
        kv_lo = 0
        kv_hi = kv_end
    else:
        tiles_per_segment = tl.cdiv(tl.cdiv(context_len, TILE_N), NUM_SEGMENTS)
        kv_lo = segment * tiles_per_segment * TILE_N
        kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_segment * TILE_N)

    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, TILE_N)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh

    # Query tiles: tiles every row of the block sees whole (keys up to the block's first
    # query position, inside the segment) need no masks: no causal or bounds test on the
    # scores, unmasked loads. The rest (the diagonal, the partial last tile) take the
    # masked path. Measured on the H200 (kernel_check --long): prefill attention of 8k and
    # 32k prompts 1.21-1.26x faster; decode (one query a row) was not faster at 8k
    # contexts, so it keeps the one masked loop.
    full_hi = kv_lo
    if BLOCK_Q > 1:
        first_q_pos = context_len - q_len + local_block * BLOCK_Q
        full_end = tl.minimum(kv_hi, first_q_pos + 1)
        full_hi = kv_lo + (tl.maximum(full_end - kv_lo, 0) // TILE_N) * TILE_N
        for tile_start in range(kv_lo, full_hi, TILE_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, tile_start, kv_hi, q_pos, offs_n, dims, dim_valid,
                block_table_row, k_head_ptr, v_head_ptr, qk_scale,
                stride_kb, stride_ks, stride_vb, stride_vs,
                BLOCK_SIZE, FP32_DOT, KV_FP8, HEAD_PAD != HEAD_SIZE, False,
            )  # fmt: skip
    for tile_start in range(full_hi, kv_hi, TILE_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile_start, kv_hi, q_pos, offs_n, dims, dim_valid,
            block_table_row, k_head_ptr, v_head_ptr, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs,
            BLOCK_SIZE, FP32_DOT, KV_FP8, HEAD_PAD != HEAD_SIZE, True,
        )  # fmt: skip

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)  # the merge of split segments is linear in acc
    if NUM_SEGMENTS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        result = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        part = (token * NUM_HEADS + head) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(
            part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )


@triton.jit(do_not_specialize=["num_seqs"])
def _merge_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr,
    num_seqs, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, SEG_CHUNK: tl.constexpr,
):  # fmt: skip
    wait_for_inputs()
    token = tl.program_id(0)
    head = tl.program_id(1)
    # Rows past the last sequence (batch padding) were never computed.
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    segments = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_PAD)
    first = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS
    seg_max = tl.load(part_max_ptr + first + segments)
    seg_sum = tl.load(part_sum_ptr + first + segments)
    top = tl.max(seg_max, axis=0)
    denom = tl.sum(tl.math.exp2(seg_max - top) * seg_sum, axis=0)  # empty: exp2(-inf) = 0
    # The partial accumulators in chunks of SEG_CHUNK segments (a [NUM_SEGMENTS, HEAD_PAD]
    # tile of 128+ segments would not fit in registers).
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for chunk in tl.static_range(0, NUM_SEGMENTS, SEG_CHUNK):
        part = first + chunk + tl.arange(0, SEG_CHUNK)
        weight = tl.math.exp2(tl.load(part_max_ptr + part) - top)
        seg_acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :])
        acc += tl.sum(seg_acc * weight[:, None], axis=0)
    result = acc / denom
    tl.store(
        out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )


def _num_segments(num_programs: int, partial_bytes_per_segment: int, device: torch.device) -> int:
    """Split the KV range until about two waves of programs fill the GPU."""
    target = 2 * num_sms(device)
    if num_programs >= target:
        return 1
    segments = triton.next_power_of_2(triton.cdiv(target, num_programs))
    while segments > 1 and segments * partial_bytes_per_segment > _MAX_PARTIAL_BYTES:
        segments //= 2
    return min(segments, _MAX_SEGMENTS)


@dataclass(frozen=True)
class Tiling:
    """What a launch is compiled for, besides the model's shapes and the cache layout:
    Triton compiles one variant per distinct tiling."""

    block_q: int  # query tokens per program (1: decode tiling)
    block_m: int  # rows per program: block_q tokens x the padded GQA group (or x 1)
    tile_n: int  # keys per inner step
    num_segments: int  # splits of the KV range (flash-decoding), a power of two
    num_warps: int
    num_stages: int
    per_head: bool = False  # a program serves one query head, not its KV head's group


def _large_query_tiles(num_tokens: int, head_size: int) -> bool:
    # Measured on H200 (kernel_check sweep, pagoda_kernels/NOTES.md): 32-key tiles and 4 warps
    # win for prefill steps below ~4k tokens; from there 128-row query tiles of 64 keys, 8
    # warps and 2 stages (kernel_check --long: 8k prompts 9 %, 32k 1-3 % faster than 32
    # keys, 4 warps, 3 stages).
    return num_tokens >= 4096 and head_size <= 128


def choose_tiling(
    num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int,
    max_query_len: int | None, device: torch.device, *, block_m: int | None = None,
    tile_n: int | None = None, num_segments: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, per_head: bool | None = None,
) -> Tiling:  # fmt: skip
    """The tiling ``paged_attention`` launches for a step of this shape; the keyword
    arguments override the heuristics (benchmarks and tests use them)."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    head_pad = max(16, triton.next_power_of_2(head_size))
    # Every sequence has exactly one query token when T == B (or the caller says so):
    # decode tiling, one token per program. Any other batch takes query tiles. Both
    # tilings are exact for every input; the choice only affects speed.
    decode = max_query_len == 1 or (max_query_len is None and num_tokens == num_seqs)
    large = block_m is None and not decode and _large_query_tiles(num_tokens, head_size)
    if per_head is None:
        per_head = large and _PER_HEAD_LARGE_TILES
    per_head = per_head and not decode
    if per_head:
        group_pad = 1
    if decode and block_m is None:
        block_q = 1
        block_m = max(16, group_pad)
    else:
        block_m = block_m or (128 if large else 64)
        block_m = max(block_m, group_pad, 16)
        block_q = max(1, block_m // group_pad)
    if tile_n is None:
        tile_n = 64 if (block_q == 1 and head_size <= 128) or large else 32
    tile_n = max(16, tile_n)
    if num_segments is None:
        # Programs with work: a step of T tokens has at most T sequences with queries; the
        # other rows (a mixed CUDA graph's spare rows) exit at once and fill nothing. A
        # mixed graph is recorded with room for every sequence, so counting its rows would
        # never split the KV range of the few real sequences it replays (a verify step of
        # k + 1 tokens over a long context ran each KV head on one program).
        working_seqs = min(num_seqs, num_tokens)
        num_q_blocks = num_tokens if block_q == 1 else num_tokens // block_q + working_seqs
        partial = num_tokens * num_heads * (head_pad + 2) * 4
        head_blocks = num_heads if per_head else num_kv_heads
        num_segments = _num_segments(num_q_blocks * head_blocks, partial, device)
    # Decode streams K/V once: two stages measured ~2% faster than three (fewer shared
    # memory buffers, more resident programs); smaller prefill tiles keep three.
    num_stages = num_stages or (2 if block_q == 1 or large else 3)
    num_warps = num_warps or (8 if large else 4)
    return Tiling(block_q, block_m, tile_n, num_segments, num_warps, num_stages, per_head)


def tilings(
    num_heads: int, num_kv_heads: int, head_size: int, max_num_tokens: int,
    device: torch.device, decode: bool,
) -> list[Tiling]:  # fmt: skip
    """Every tiling ``choose_tiling`` can pick (without overrides) for decode steps or for
    steps with longer queries of up to ``max_num_tokens`` tokens: what a warm-up must
    compile so that no request waits for a Triton compile."""
    if decode:
        shapes = [(1, 1)]  # (tokens, max query length): one program per token
    else:
        shapes = [(2, 2)]  # 64-row query tiles, down to the smallest step
        if _large_query_tiles(max_num_tokens, head_size):
            shapes.append((4096, 2))  # the fewest tokens that take 128-row tiles
    found = []
    for num_tokens, max_query_len in shapes:
        base = choose_tiling(num_tokens, 1, num_heads, num_kv_heads, head_size, max_query_len,
                             device, num_segments=1)  # fmt: skip
        # The most segments a step with this tiling can split into: its fewest programs.
        fewest_programs = (1 if base.block_q == 1 else num_tokens // base.block_q + 1)
        head_blocks = num_heads if base.per_head else num_kv_heads
        most = _num_segments(fewest_programs * head_blocks, 0, device)
        segments = 1
        while segments <= most:
            found.append(replace(base, num_segments=segments))
            segments *= 2
    return found


def warm_up(
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
    max_num_tokens: int, decode: bool, q_dtype: torch.dtype | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> list[Tiling]:  # fmt: skip
    """Compile (by launching once) every variant ``tilings`` lists, on a one-sequence step
    that reads block 0 only and writes a scratch output; returns the tilings run.
    ``q_dtype``: the queries' (the model's) dtype, needed when the cache is FP8 (default:
    the cache's dtype); the scales as the model passes them."""
    _, block_size, num_kv_heads, head_size = k_cache.shape
    found = tilings(num_heads, num_kv_heads, head_size, max_num_tokens, k_cache.device, decode)
    for tiling in found:
        # The large-tile variant is picked by token count; any count gives the same code.
        num_tokens = 1 if tiling.block_q == 1 else 2
        q = torch.zeros(num_tokens, num_heads, head_size, dtype=q_dtype or k_cache.dtype,
                        device=k_cache.device)  # fmt: skip
        num_blocks = -(-num_tokens // block_size)
        block_tables = torch.zeros((1, num_blocks), dtype=torch.int32, device=k_cache.device)
        seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=k_cache.device)
        query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32, device=k_cache.device)
        _launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                torch.empty_like(q), k_scale, v_scale, tiling)  # fmt: skip
    return found


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_segments: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    per_head: bool | None = None,
) -> torch.Tensor:
    """Same contract as ``kernels.attention.paged_attention_ref``. The keyword-only
    arguments override the tiling heuristics (benchmarks and tests use them)."""
    num_tokens, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1 or out.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("paged_attention needs the head dimension contiguous")
    if v_cache.stride(-1) != 1 or block_size & (block_size - 1):
        raise ValueError("paged_attention needs a contiguous head dim and power-of-2 blocks")
    tiling = choose_tiling(
        num_tokens, num_seqs, num_heads, num_kv_heads, head_size, max_query_len, q.device,
        block_m=block_m, tile_n=tile_n, num_segments=num_segments, num_warps=num_warps,
        num_stages=num_stages, per_head=per_head,
    )
    _launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out, k_scale,
            v_scale, tiling)  # fmt: skip
    return out


def _launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
            k_scale, v_scale, tiling: Tiling) -> None:  # fmt: skip
    num_tokens, num_heads, head_size = q.shape
    kv_fp8, k_scale, v_scale = scale_args(k_cache, v_cache, k_scale, v_scale)
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    heads = 1 if tiling.per_head else group
    head_pad = max(16, triton.next_power_of_2(head_size))
    block_q, num_segments = tiling.block_q, tiling.num_segments
    num_q_blocks = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    if num_segments > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, num_segments, head_pad), dtype=torch.float32, device=q.device
        )
        part_max = torch.empty(
            (num_tokens, num_heads, num_segments), dtype=torch.float32, device=q.device
        )
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched

    log2e = 1.4426950408889634
    _paged_attention_kernel[(num_q_blocks, num_heads // heads, num_segments)](
        q, k_cache, v_cache, out, k_scale, v_scale,
        part_acc, part_max, part_sum,
        block_tables, seq_lens, query_start_loc,
        scale * log2e, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_HEADS=num_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        GROUP=group, HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads),
        BLOCK_Q=block_q, BLOCK_M=tiling.block_m, TILE_N=tiling.tile_n,
        BLOCK_SIZE=block_size, NUM_SEGMENTS=num_segments,
        FP32_DOT=q.dtype == torch.float32, KV_FP8=kv_fp8,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        launch_pdl=launch_pdl(out),
    )  # fmt: skip
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, query_start_loc,
            num_seqs, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
            NUM_SEGMENTS=num_segments, SEG_CHUNK=min(num_segments, 32),
            num_warps=4 if head_pad >= 128 else 2,
            launch_pdl=launch_pdl(out),
        )  # fmt: skip
