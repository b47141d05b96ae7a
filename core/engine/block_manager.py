from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence

NO_HASH = -1


def compute_block_hash(prefix_hash: int, token_ids: list[int]) -> int:
    """Chained hash of a full block: xxh64(prefix hash as 8 bytes || token ids as int64)."""
    h = xxhash.xxh64()
    if prefix_hash != NO_HASH:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: list[int] = field(default_factory=list)


@dataclass
class PrefixCacheStats:
    lookups: int = 0  # sequences whose prompt was looked up
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, tokens served from the cache
    shared_blocks: int = 0  # hits on a block another running sequence holds
    resurrected_blocks: int = 0  # hits on a freed block that still had its hash
    evictions: int = 0  # hashed free blocks handed out for new content

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockManager:
    """Owns the physical KV blocks: allocation, ref counts and the prefix cache (docs/ARCHITECTURE.md).

    A block is either free (in `free_blocks`, FIFO: the oldest freed block is reused first) or used. Freed
    blocks keep their hash, so a later request can take them back until they are handed out again.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_fn=compute_block_hash):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_blocks: set[int] = set()
        self.hash_to_block: dict[int, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return len(self.used_blocks) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix lookup and allocation -------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`'s full blocks (no side effects)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prefix_hash = NO_HASH
        for start in range(0, seq.num_tokens - self.block_size + 1, self.block_size):
            token_ids = seq.token_ids[start:start + self.block_size]
            prefix_hash = self.hash_fn(prefix_hash, token_ids)
            block_id = self.hash_to_block.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def admit(self, seq: Sequence, max_new_tokens: int) -> bool:
        """Give a waiting `seq` its prefix-cache hits and slots for up to `max_new_tokens` tokens after them, or
        return False (and change nothing) when the free blocks do not suffice. Sets `num_computed_tokens` to the
        tokens the hits serve; at least one token is left to compute."""
        # A request for prompt logprobs needs the logits of every prompt position: it takes no hits.
        return self._place(seq, self.match_prefix(seq) if seq.params.prompt_logprobs is None else [],
                           max_new_tokens, lookup=True)

    def fork(self, parent: Sequence, child: Sequence, max_new_tokens: int) -> bool:
        """Admit a waiting `child` (a sibling completion of the same prompt) onto `parent`'s computed full prompt
        blocks, shared by ref count; the child recomputes the prompt's last partial block (at least its last
        token, for its own logits) into a fresh block instead of copying it. False (nothing changed) when the
        free blocks do not suffice."""
        num_shared = min(parent.num_computed_tokens, parent.num_prompt_tokens) // self.block_size
        if child.params.prompt_logprobs is not None:
            num_shared = 0
        return self._place(child, parent.block_table[:num_shared], max_new_tokens, lookup=False)

    def _place(self, seq: Sequence, hits: list[int], max_new_tokens: int, lookup: bool) -> bool:
        assert not seq.block_table, "sequence already holds blocks"
        # A fully cached prompt still needs its last token computed to get logits.
        num_computed = min(len(hits) * self.block_size, seq.num_tokens - 1)
        num_new = min(seq.num_tokens - num_computed, max_new_tokens)
        fresh = max(self.blocks_for(num_computed + num_new) - len(hits), 0)
        resurrected = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if fresh + resurrected > self.num_free_blocks:
            return False
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
                self.used_blocks.add(block_id)
                self.stats.resurrected_blocks += 1
            else:
                self.stats.shared_blocks += 1
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_shared_kv_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits) if lookup else 0
        seq.num_computed_tokens = num_computed
        if self.enable_prefix_caching and lookup:
            self.stats.lookups += 1
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += num_computed
        if seq.num_prefix_hit_tokens is None:
            seq.num_prefix_hit_tokens = num_computed
        for _ in range(fresh):
            seq.block_table.append(self._take_free_block())
        return True

    def try_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Append fresh blocks until `seq` has slots for its first `num_tokens` tokens; False (and nothing
        taken) when the free blocks do not suffice."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > len(self.free_blocks):
            return False
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            self.stats.evictions += 1
        block.hash = NO_HASH
        block.token_ids = []
        block.ref_count = 1
        self.used_blocks.add(block_id)
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks. Tail blocks go first into the queue, so they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_blocks.remove(block_id)
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_shared_kv_tokens = 0
        seq.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Drop the hashes of free blocks: later requests find only what running sequences hold."""
        for block_id in self.free_blocks:
            block = self.blocks[block_id]
            if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = NO_HASH
            block.token_ids = []

    # ---- hashing as blocks fill ----------------------------------------------------------------------------

    def commit_computed_blocks(self, seq: Sequence, num_known_tokens: int | None = None) -> None:
        """Hash every block of `seq` whose tokens are all computed (prefill chunks and decode alike).

        `num_known_tokens` caps what counts as computed (the async loop passes the committed count).
        """
        if not self.enable_prefix_caching:
            return
        limit = seq.num_computed_tokens if num_known_tokens is None else num_known_tokens
        num_full = min(limit // self.block_size, len(seq.block_table))
        for index in range(seq.num_hashed_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            prefix_hash = self.blocks[seq.block_table[index - 1]].hash if index else NO_HASH
            token_ids = seq.token_ids[index * self.block_size:(index + 1) * self.block_size]
            block.hash = self.hash_fn(prefix_hash, token_ids)
            block.token_ids = token_ids
            self.hash_to_block.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)
