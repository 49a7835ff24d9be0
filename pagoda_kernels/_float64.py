"""Float64 ground truth for kernel tests and the GPU kernel check.

Written independently of the ``*_ref`` functions (which compute in float32, like the
kernels), so that both the references and the kernels are measured against exact math.
These loop over sequences on the host: for checking only, never for serving.
"""

import torch


def attention64(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal paged attention in float64; rows past ``query_start_loc[-1]`` stay zero."""
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    starts = query_start_loc.tolist()
    for seq, context_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        if q_end == q_start:
            continue
        positions = torch.arange(context_len, device=q.device)
        blocks = block_tables[seq].long()[positions // k_cache.shape[1]]
        offsets = positions % k_cache.shape[1]
        keys = k_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
        values = v_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
        queries = q[q_start:q_end].double()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_pos = positions[context_len - (q_end - q_start) :]
        scores.masked_fill_(positions[None, :] > query_pos[:, None], float("-inf"))
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def rms_norm64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rotary64(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()].double()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul64(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    gate, up = x.double()[..., :half], x.double()[..., half:]
    return gate * torch.sigmoid(gate) * up


def fp8_linear64(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FP8 scheme of ``kernels.fp8_linear`` in float64: x quantized per token to
    float8_e4m3fn (scale amax / 448, floored as vLLM), exact products and sums."""
    rows = x.double().reshape(-1, x.shape[-1])
    scale = (rows.abs().amax(dim=-1, keepdim=True) / 448.0).clamp_min(1.0 / (448.0 * 512.0))
    quantized = (rows / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double()
    out = quantized @ weight.double().T * scale * weight_scale.double()[None, :]
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*x.shape[:-1], weight.shape[0])


def token_bitmask64(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None
) -> torch.Tensor:
    """A copy of ``logits`` in float64 with -inf where row ``rows[i]``'s token t has bit
    t % 32 of word t // 32 of ``bitmask[i]`` clear (or lies past the words), one token at
    a time."""
    out = logits.double().cpu().clone()
    words = bitmask.cpu().tolist()
    for i, row_words in enumerate(words):
        row = i if rows is None else rows[i]
        for token in range(out.shape[1]):
            word = row_words[token // 32] if token // 32 < len(row_words) else 0
            if not (word >> (token % 32)) & 1:  # Python ints: the sign bit is bit 31 too
                out[row, token] = float("-inf")
    return out


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; inf if ``actual`` has a NaN/inf."""
    actual64, expected64 = actual.double(), expected.double()
    if not torch.isfinite(actual64).all():
        return float("inf")
    return ((actual64 - expected64).norm() / expected64.norm().clamp_min(1e-30)).item()
