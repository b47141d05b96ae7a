"""Logprobs of the raw distribution: log_softmax of float32 logits, the token's rank, the top-k."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.layers.logprobs import chunked_logprobs, compute_logprobs  # noqa: E402


def expected(logits, token_ids, num_top):
    reference = torch.log_softmax(logits.double(), dim=-1)
    chosen = reference.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    ranks = (reference >= chosen.unsqueeze(1)).sum(dim=-1)
    top = reference.topk(num_top, dim=-1)
    return chosen, ranks, top


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_equal_log_softmax_of_float32_logits(dtype):
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 3000, generator=generator) * 4).to(dtype)
    token_ids = torch.randint(0, 3000, (9,), generator=generator)
    token_ids[0] = logits[0].float().argmax()
    result = compute_logprobs(logits, token_ids, num_top=5)
    chosen, ranks, top = expected(logits.float(), token_ids, 5)
    torch.testing.assert_close(result.logprobs.double(), chosen, atol=1e-5, rtol=0)
    assert torch.equal(result.ranks, ranks)
    assert result.ranks[0] == 1
    assert torch.equal(result.top_ids, top.indices)
    torch.testing.assert_close(result.top_logprobs.double(), top.values, atol=1e-5, rtol=0)


def test_ranks_count_ties_as_ahead_and_zero_top():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    result = compute_logprobs(logits, torch.tensor([2]), num_top=0)
    assert result.ranks.tolist() == [3]
    assert result.top_ids.shape == (1, 0)
    with pytest.raises(ValueError, match="num_top"):
        compute_logprobs(logits, torch.tensor([2]), num_top=6)


def test_prompt_logprobs_in_chunks_equal_one_pass():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(37, 500, generator=generator) * 3
    next_ids = torch.randint(0, 500, (37,), generator=generator)
    chunked = chunked_logprobs(lambda start, end: logits[start:end], next_ids, num_top=3, chunk_rows=8)
    chosen, ranks, top = expected(logits, next_ids, 3)
    torch.testing.assert_close(chunked.logprobs.double(), chosen, atol=1e-5, rtol=0)
    assert torch.equal(chunked.ranks, ranks)
    assert torch.equal(chunked.top_ids, top.indices)


def stable_top(logits, num_top):
    """The num_top largest logprobs, ties by the smaller id (a stable descending sort)."""
    order = torch.sort(-torch.log_softmax(logits.double(), dim=-1), dim=-1, stable=True)
    return order.indices[:, :num_top], -order.values[:, :num_top]


@pytest.mark.parametrize("num_top", [0, 1, 5, 8])
def test_logprob_kernels_equal_torch(num_top):
    """The two-kernel path (segments, then their combination) on rows that stress it: a segment of -inf only, a
    tied top spread over segments, fewer finite logits than num_top, a sampled token that is -inf."""
    pytest.importorskip("triton")
    from nanovllm.kernels.logprobs import logprobs_and_top

    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(6, 1000, generator=generator) * 5).to(torch.bfloat16)
    logits[1, :300] = float("-inf")
    logits[2] = 0.5  # a tie at the top across the four segments of 256: ids 3, 300, 600, 900, then 0, 1, 2, ...
    logits[2, [900, 600, 300, 3]] = 1.0
    logits[3, 10:] = float("-inf")
    logits[4, 5:] = float("-inf")  # 5 finite logits: the 6th top token onwards is -inf, the smaller id first
    token_ids = torch.randint(300, 1000, (6,), generator=generator)
    token_ids[5] = 7
    logits[5, 7] = float("-inf")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logprob, rank, top_ids, top_logprobs, log_z = logprobs_and_top(logits.to(device), token_ids.to(device), num_top,
                                                                   segment=256)
    chosen, ranks, _ = expected(logits.float(), token_ids, 1)
    torch.testing.assert_close(logprob.cpu().double(), chosen, atol=1e-5, rtol=0)
    assert torch.equal(rank.cpu(), ranks)
    torch.testing.assert_close(log_z.cpu().double(), torch.logsumexp(logits.double(), dim=-1), atol=1e-5, rtol=0)
    want_ids, want_values = stable_top(logits.float(), num_top)
    assert torch.equal(top_ids.cpu(), want_ids)
    torch.testing.assert_close(top_logprobs.cpu().double(), want_values, atol=1e-5, rtol=0)
    if num_top == 8:
        assert top_ids[2, :4].tolist() == [3, 300, 600, 900] and top_ids[4, 5:].tolist() == [5, 6, 7]


def test_a_sampled_token_of_minus_infinity_leaves_the_top_logprobs_finite():
    """A structured mask can leave the sampled token's raw logit at -inf: its logprob is -inf, and the row's top
    tokens keep their logprobs (log Z comes from the row, not from the token)."""
    logits = torch.tensor([[2.0, 1.0, float("-inf"), 0.5]])
    result = compute_logprobs(logits, torch.tensor([2]), num_top=2)
    assert result.logprobs.item() == float("-inf")
    torch.testing.assert_close(result.top_logprobs, torch.log_softmax(logits, dim=-1)[:, :2])


@pytest.mark.gpu
@pytest.mark.parametrize("num_top", [5, 20])  # the kernels' top tokens, and the top-k past their MAX_TOP
def test_gpu_logprobs_at_real_shape(num_top):
    logits = (torch.randn(64, 151936, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 4)
    logits = logits.to(torch.bfloat16)
    token_ids = torch.randint(0, 151936, (64,), device="cuda")
    result = compute_logprobs(logits, token_ids, num_top=num_top)
    chosen, ranks, top = expected(logits.float(), token_ids, num_top)
    torch.testing.assert_close(result.logprobs.double(), chosen, atol=1e-4, rtol=0)
    assert torch.equal(result.ranks, ranks)
    torch.testing.assert_close(result.top_logprobs.double(), top.values, atol=1e-4, rtol=0)
