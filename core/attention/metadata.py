from __future__ import annotations

import dataclasses
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
    # In a step with longer queries too: the leading sequences that compute one token each (running decodes, which
    # the scheduler puts first). A backend may give them its decode path; decode_num_splits is then theirs.
    num_decodes: int = 0
    # Per KV group (kv_groups.py) of a model with several: the same step with that group's slots and tables
    # (this object is group 0's). Empty with one group.
    groups: tuple[AttentionMetadata, ...] = ()

    @classmethod
    def grouped(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, **step) -> AttentionMetadata:
        """The metadata of a step over KV groups: `slot_mapping` [groups, tokens] and `block_tables`
        [groups, batch, max_blocks] give each group's; `step` the fields they share."""
        views = tuple(cls(slot_mapping=slot_mapping[g], block_tables=block_tables[g], **step)
                      for g in range(len(slot_mapping)))
        return views[0] if len(views) == 1 else dataclasses.replace(views[0], groups=views)

    def for_group(self, group: int) -> AttentionMetadata:
        return self.groups[group] if self.groups else self
