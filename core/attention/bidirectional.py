"""Bidirectional (encoder) attention over a flat batch of whole sequences, without a KV cache.

Every token of a sequence sees every token of it, so a sequence is computed in one step and nothing is kept for a
later one: the paged causal kernels, which read the context from the cache, do not apply. The sequences are
scattered into a padded [batch, heads, longest, head_dim] batch and attended in one `scaled_dot_product_attention`
call with a key-padding mask (one launch per layer, whatever the batch; padded query rows are computed and dropped).
The alternatives cost more: one call per sequence launches a kernel per sequence per layer, and a block-diagonal
mask over the flat batch computes tokens² scores instead of batch × longest²."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def padded_layout(cu_seqlens: torch.Tensor, num_tokens: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot of each token in a [batch × max_len] padded layout, [batch, max_len] mask of the real tokens), for
    `num_tokens` tokens of sequences that are the consecutive ranges `cu_seqlens[i]:cu_seqlens[i+1]`."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths,
                                           output_size=num_tokens)
    offset_in_seq = torch.arange(num_tokens, device=cu.device) - cu[:-1][seq_of_token]
    mask = torch.arange(max_len, device=cu.device).unsqueeze(0) < lengths.unsqueeze(1)
    return seq_of_token * max_len + offset_in_seq, mask


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                            scale: float) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim] of whole sequences (`cu_seqlens`: [batch + 1] starts, `max_len`: the
    longest) -> [tokens, heads, head_dim]; each token attends over all tokens of its own sequence."""
    slots, mask = padded_layout(cu_seqlens, q.shape[0], max_len)
    batch, heads, dim = mask.shape[0], q.shape[1], q.shape[2]

    def padded(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(batch * max_len, heads, dim)
        out[slots] = x
        return out.view(batch, max_len, heads, dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask[:, None, None, :],
                                         scale=scale)
    return out.transpose(1, 2).reshape(batch * max_len, heads, dim)[slots]
