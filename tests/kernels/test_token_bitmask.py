"""The grammar mask: the Triton kernel (interpreted) and the reference against a
token-by-token float64 ground truth. Masking copies or replaces values, so results are
compared exactly."""

import numpy as np
import pytest
import torch

from pagoda_kernels import apply_token_bitmask, apply_token_bitmask_ref
from pagoda_kernels._float64 import token_bitmask64
from pagoda_kernels.token_bitmask import unpack_allowed, unpack_bytes


def random_words(rows: int, words: int, seed: int) -> torch.Tensor:
    """Random int32 words (the sign bit, bit 31, set in about half of them), with one row
    all zeros and one all ones."""
    values = np.random.default_rng(seed).integers(-(2**31), 2**31, (rows, words))
    bitmask = torch.from_numpy(values.astype(np.int32))
    bitmask[0] = 0
    if rows > 1:
        bitmask[1] = -1
    return bitmask


@pytest.mark.parametrize("op", [apply_token_bitmask, apply_token_bitmask_ref])
@pytest.mark.parametrize(
    "batch, vocab, words, rows",
    [
        (3, 100, 4, None),  # vocab not a multiple of 32: the last word is partly unused
        (5, 100, 4, [0, 2, 4]),  # only some rows constrained
        (2, 70, 2, None),  # the bitmask covers 64 tokens: 64..69 are forbidden
        (4, 5000, 157, [3, 1]),  # several token blocks; rows in any order
        (1, 33, 2, [0]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_matches_float64(op, batch, vocab, words, rows, dtype) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(batch, vocab).to(dtype)
    bitmask = random_words(batch if rows is None else len(rows), words, seed=batch)
    expected = token_bitmask64(logits, bitmask, rows)
    index = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    result = op(logits, bitmask, index)
    assert result is logits  # in place
    assert torch.equal(result.double(), expected)


def test_unpacking_with_numpy_and_with_torch_agree() -> None:
    """The host unpacks with NumPy, a device with shifts of the uint8 view: same bits."""
    bitmask = random_words(3, 5, seed=0)
    assert torch.equal(unpack_bytes(bitmask)[:, :150], unpack_allowed(bitmask, 150))
