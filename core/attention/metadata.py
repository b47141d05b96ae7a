from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the paged KV cache.

    The new tokens of sequence i are the last `query_start_loc[i+1] - query_start_loc[i]` positions of its context
    of `seq_lens[i]` tokens; all earlier positions are already in the cache (prefix hits, earlier chunks, decode).
    """

    slot_mapping: torch.Tensor  # [num_tokens] cache slot per new token; -1 = do not write
    query_start_loc: torch.Tensor  # [batch + 1] int32 cumulative query lengths
    seq_lens: torch.Tensor  # [batch] int32 context length including the new tokens
    block_tables: torch.Tensor  # [batch, max_blocks] int32; entries past a sequence's blocks are -1
    max_query_len: int
    max_seq_len: int
    decode_num_splits: int = 1  # decode kernels split each sequence's KV range this many ways (flash-decoding)
