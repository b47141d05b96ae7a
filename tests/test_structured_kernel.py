"""The grammar bitmask kernel (Triton; the interpreter on the CPU) against the torch reference, a hand-written
case and xgrammar's own apply function."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported

from nanovllm.kernels.token_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_torch,
    apply_token_bitmask_triton,
    bitmask_width,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_case(num_rows: int, vocab: int, row_indices: list[int], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(row_indices), bitmask_width(vocab)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    return logits.to(DEVICE), bitmask.to(DEVICE), torch.tensor(row_indices, dtype=torch.int64, device=DEVICE)


def test_torch_reference_matches_hand_computed_bits():
    vocab = 40  # two words, the second one only partly used
    logits = torch.arange(3 * vocab, dtype=torch.float32).view(3, vocab)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 0) | (1 << 5) | -(1 << 31)  # tokens 0, 5, 31 (the sign bit) of the first word
    bitmask[0, 1] = (1 << 3) | (1 << 20)  # token 35; bit 20 is token 52, past the vocabulary
    bitmask[1, 1] = -1  # tokens 32..39
    expected = logits.clone()
    expected[2] = float("-inf")
    expected[2, [0, 5, 31, 35]] = logits[2, [0, 5, 31, 35]]
    expected[0, :32] = float("-inf")
    apply_token_bitmask_torch(logits, bitmask, torch.tensor([2, 0]))
    assert torch.equal(logits, expected)  # row 1 is named by no entry: untouched


@pytest.mark.parametrize("vocab", [31, 1000, 4096 + 17, 2 * 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_torch_reference(vocab, dtype):
    # Rows 1 and 4 are unconstrained; -1 entries are launch padding.
    row_indices = [3, -1, 0, 5, 2, -1]
    logits, bitmask, rows = random_case(6, vocab, row_indices, dtype, seed=vocab)
    expected = logits.clone()
    apply_token_bitmask_torch(expected, bitmask, rows)
    original = logits.clone()
    apply_token_bitmask_triton(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.equal(logits[[1, 4]], original[[1, 4]])
    assert torch.isinf(logits[[0, 2, 3, 5]]).any()  # the masks did mask something


@pytest.mark.parametrize("mask_vocab, vocab", [(64, 100), (4096, 4096 + 4096 + 37)])
def test_tokens_past_a_narrower_bitmask_become_minus_inf(mask_vocab, vocab):
    """A model's vocabulary padded past its tokenizer's: the bitmask covers the tokenizer's words only."""
    logits, _, rows = random_case(3, vocab, [2, 0], torch.float32, seed=mask_vocab)
    bitmask = torch.full((2, bitmask_width(mask_vocab)), -1, dtype=torch.int32, device=DEVICE)  # all allowed
    bitmask[1] = 0
    bitmask[1, 0] = 0b1010  # tokens 1 and 3 only
    expected = logits.clone()
    expected[2, mask_vocab:] = float("-inf")
    expected[0] = float("-inf")
    expected[0, [1, 3]] = logits[0, [1, 3]]
    reference = logits.clone()
    apply_token_bitmask_torch(reference, bitmask, rows)
    apply_token_bitmask_triton(logits, bitmask, rows)
    assert torch.equal(reference, expected) and torch.equal(logits, expected)  # row 1 untouched


def test_kernel_on_a_strided_logits_view():
    logits, bitmask, rows = random_case(4, 1000, [1, 3], torch.float32, seed=1)
    wide = torch.zeros(4, 1100, device=DEVICE)
    wide[:, :1000] = logits
    view = wide[:, :1000]
    apply_token_bitmask_torch(logits, bitmask, rows)
    apply_token_bitmask_triton(view, bitmask, rows)
    assert torch.equal(view, logits)
    assert torch.equal(wide[:, 1000:], torch.zeros(4, 100, device=DEVICE))


def test_matches_xgrammar_apply():
    xgr = pytest.importorskip("xgrammar")
    vocab = 1000
    logits, bitmask, _ = random_case(5, vocab, [0, 1, 2, 3, 4], torch.float32, seed=7)
    ours = logits.clone()
    apply_token_bitmask(ours, bitmask[[1, 3]], torch.tensor([1, 3], device=DEVICE))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=[1, 3])
    assert torch.equal(ours, theirs)


def test_empty_and_bad_inputs():
    logits, bitmask, _ = random_case(2, 100, [0], torch.float32, seed=0)
    before = logits.clone()
    apply_token_bitmask(logits, bitmask[:0], torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="words per row"):  # wider than the vocabulary (narrower is allowed)
        apply_token_bitmask(logits, torch.zeros(1, 5, dtype=torch.int32, device=DEVICE),
                            torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, bitmask.long(), torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="row indices but only"):
        apply_token_bitmask(logits, bitmask, torch.zeros(2, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
def test_kernel_matches_torch_at_serving_shape():
    vocab, batch = 151_936, 256
    rows = torch.randperm(batch)[:200].tolist() + [-1] * 56
    logits, bitmask, row_indices = random_case(batch, vocab, rows, torch.bfloat16, seed=3)
    expected = logits.clone()
    apply_token_bitmask_torch(expected, bitmask, row_indices)
    apply_token_bitmask(logits, bitmask, row_indices)
    torch.cuda.synchronize()
    assert torch.equal(logits, expected)
