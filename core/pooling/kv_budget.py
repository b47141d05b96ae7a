"""The KV cache a pooling engine needs: only what its prefills in flight hold (a row keeps no KV once pooled).

A decoder's pooling row takes the blocks of its whole prompt when it is admitted and gives them back when its
last chunk is committed (engine/pooling_scheduler.py). The rows of one step hold at most its token budget plus
two rows that the step computes only in part (the first, continued from before, and the last, cut by the
budget), each block rounded up; the async loop has two steps in flight. A larger cache would only hold prefixes
for later hits, which random or distinct rows rarely get: the memory serves larger batches instead."""
from __future__ import annotations


def pooling_kv_blocks(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int,
                      num_groups: int = 1) -> int:
    """Blocks enough for two steps of prefills in flight (see the module docstring)."""
    tokens = max_num_batched_tokens + 2 * max_model_len
    return 2 * (-(-tokens // block_size) + min(max_num_seqs, max_num_batched_tokens)) * num_groups
