"""The torch backend's batched decode path against its per-sequence reference (the kernels' oracle)."""
import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import paged_attention, paged_decode_attention


def test_batched_decode_matches_per_sequence_reference():
    torch.manual_seed(0)
    block_size, num_blocks, kv_heads, heads, dim = 4, 40, 2, 6, 8
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim).unbind(0)
    seq_lens = torch.tensor([1, 7, 13, 4], dtype=torch.int32)
    order = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.full((4, 5), -1, dtype=torch.int32)  # ragged tables: -1 past each sequence's blocks
    start = 0
    for i, n in enumerate(seq_lens.tolist()):
        count = -(-n // block_size)
        tables[i, :count] = order[start:start + count]
        start += count
    meta = AttentionMetadata(slot_mapping=torch.full((4,), -1), query_start_loc=torch.arange(5, dtype=torch.int32),
                             seq_lens=seq_lens, block_tables=tables, max_query_len=1, max_seq_len=13)
    # Every slot no sequence holds is NaN, as an unused cache slot may be: the batched path must never let one in.
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, n in enumerate(seq_lens.tolist()):
        positions = torch.arange(n)
        used[tables[i, positions // block_size].long() * block_size + positions % block_size] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, kv_heads, dim)[~used] = float("nan")
    q = torch.randn(4, heads, dim)
    expected = paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert expected.isfinite().all()
    assert torch.allclose(paged_decode_attention(q, k_cache, v_cache, meta, 0.3), expected, atol=1e-5)
