from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import xxhash

from nanovllm.engine.sequence import Sequence
from nanovllm.kv_groups import NO_BLOCK

NO_HASH = -1


def compute_block_hash(prefix_hash: int, token_ids: list[int]) -> int:
    """Chained hash of a full block: xxh64(prefix hash as 8 bytes || token ids as int64)."""
    h = xxhash.xxh64()
    if prefix_hash != NO_HASH:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


def chain_start(seq: Sequence) -> int:
    """The hash a sequence's block chain starts from. The KV of a LoRA adapter's rows is not the base model's nor
    another adapter's: the adapter's id seeds the chain, so two adapters never share a cached block."""
    if seq.lora_request is None:
        return NO_HASH
    return xxhash.xxh64_intdigest(b"lora" + seq.lora_request.lora_int_id.to_bytes(8, "little"))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: list[int] = field(default_factory=list)
    group: int = 0  # the KV group whose lookup holds its hash


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


def _last_missing(found: list[list[int]], group: int) -> list[int]:
    """Per index of `found` (rows of each group's block or NO_BLOCK), the last index up to it where `group`'s
    block is NO_BLOCK; -1 before the first."""
    return list(accumulate((index if row[group] == NO_BLOCK else -1 for index, row in enumerate(found)), max))


class BlockManager:
    """Owns the physical KV blocks: allocation, ref counts and the prefix cache (docs/ARCHITECTURE.md).

    A block is either free (in `free_blocks`, FIFO: the oldest freed block is reused first) or used. Freed
    blocks keep their hash, so a later request can take them back until they are handed out again. With several
    KV groups (kv_groups.py) every group takes blocks from the one pool, a sequence's table interleaves them, and
    a block's hash is looked up within its own group; a windowed group's blocks behind its window go back to the
    pool as the sequence advances (`try_grow`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_fn=compute_block_hash,
                 windows: tuple[int | None, ...] = (None,)):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.windows = windows  # per KV group (kv_groups.py): its sliding window, None for global attention
        self.num_groups = len(windows)
        self._global_groups = [group for group, window in enumerate(windows) if window is None]
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.used_blocks: set[int] = set()
        self.hash_to_block: list[dict[int, int]] = [{} for _ in self.windows]  # per group
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return len(self.used_blocks) / self.num_blocks if self.num_blocks else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Logical blocks (one per group each) that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ---- prefix lookup and allocation -------------------------------------------------------------------

    def match_prefix(self, seq: Sequence, max_blocks: int | None = None) -> list[int]:
        """The table entries (interleaved by group) of the longest cached prefix of `seq`'s full blocks (at most
        `max_blocks`) that every group can serve (no side effects): a global group needs each block of the prefix,
        a windowed group only those its window reaches from the first position left to compute (the others are
        NO_BLOCK)."""
        if not self.enable_prefix_caching:
            return []
        found: list[list[int]] = []  # per logical block: each group's cached block or NO_BLOCK
        prefix_hash = chain_start(seq)
        end = seq.num_tokens if max_blocks is None else min(seq.num_tokens, max_blocks * self.block_size)
        for start in range(0, end - self.block_size + 1, self.block_size):
            token_ids = seq.token_ids[start:start + self.block_size]
            prefix_hash = self.hash_fn(prefix_hash, token_ids)
            row = [self._cached(lookup, prefix_hash, token_ids) for lookup in self.hash_to_block]
            if any(row[group] == NO_BLOCK for group in self._global_groups):
                break  # a global group misses it: no longer prefix can be served
            found.append(row)
        return self._usable_prefix(found, seq.num_tokens)

    def _cached(self, lookup: dict[int, int], prefix_hash: int, token_ids: list[int]) -> int:
        """The block of `lookup` holding a full block of `token_ids` after the prefix `prefix_hash`, or NO_BLOCK."""
        block_id = lookup.get(prefix_hash, NO_BLOCK)
        return block_id if block_id == NO_BLOCK or self.blocks[block_id].token_ids == token_ids else NO_BLOCK

    def _usable_prefix(self, found: list[list[int]], num_tokens: int) -> list[int]:
        """The longest prefix of `found` (per logical block, each group's block or NO_BLOCK; global groups
        complete) whose windowed groups hold every block their window needs, as flat table entries. Linear in
        `found`: a long prompt whose windowed blocks are gone must not cost a scan per candidate length."""
        last_missing = [(window, _last_missing(found, group))
                        for group, window in enumerate(self.windows) if window is not None]
        for num_blocks in range(len(found), 0, -1):
            first = min(num_blocks * self.block_size, num_tokens - 1)  # the first position left to compute
            if all(missing[num_blocks - 1] < self._first_needed(first, window) for window, missing in last_missing):
                return self._entries_from(found[:num_blocks], first)
        return []

    def _first_needed(self, first: int, window: int | None) -> int:
        """The first logical block a group of this `window` reads when computing from position `first` on."""
        return 0 if window is None else max((first - window + 1) // self.block_size, 0)

    def _entries_from(self, found: list[list[int]], first: int) -> list[int]:
        """Flat table entries of `found` for a sequence computing from position `first` on: NO_BLOCK where a
        windowed group's block lies behind every window from there."""
        needed_from = [self._first_needed(first, window) for window in self.windows]
        entries: list[int] = []
        for index, row in enumerate(found):
            entries += [block_id if index >= start else NO_BLOCK for block_id, start in zip(row, needed_from)]
        return entries

    def admit(self, seq: Sequence, max_new_tokens: int, prefix_hits: bool = True) -> bool:
        """Give a waiting `seq` its prefix-cache hits and slots for up to `max_new_tokens` tokens after them, or
        return False (and change nothing) when the free blocks do not suffice. Sets `num_computed_tokens` to the
        tokens the hits serve; at least one token is left to compute. `prefix_hits` False: none (a pooling row
        pooled over every position needs each one's hidden state)."""
        limit = self._hit_limit(seq)
        hits = self.match_prefix(seq, limit) if prefix_hits and limit != 0 else []
        return self._place(seq, hits, max_new_tokens, lookup=True)

    def _hit_limit(self, seq: Sequence) -> int | None:
        """The most blocks of `seq` another sequence's KV may serve: a request for prompt logprobs needs the
        logits of every prompt position from `prompt_logprobs_from` on, so only blocks wholly before it."""
        return None if seq.params.prompt_logprobs is None else seq.prompt_logprobs_from // self.block_size

    def fork(self, parent: Sequence, child: Sequence, max_new_tokens: int) -> bool:
        """Admit a waiting `child` (a sibling completion of the same prompt) onto `parent`'s computed full prompt
        blocks, shared by ref count (as far as the parent still holds what the child's windows need); the child
        recomputes the prompt's last partial block (at least its last token, for its own logits) into a fresh
        block instead of copying it. False (nothing changed) when the free blocks do not suffice."""
        num_shared = min(parent.num_computed_tokens, parent.num_prompt_tokens) // self.block_size
        limit = self._hit_limit(child)
        if limit is not None:
            num_shared = min(num_shared, limit)
        groups = self.num_groups
        found = [parent.block_table[i * groups:(i + 1) * groups] for i in range(num_shared)]
        return self._place(child, self._usable_prefix(found, child.num_tokens), max_new_tokens, lookup=False)

    def _place(self, seq: Sequence, hits: list[int], max_new_tokens: int, lookup: bool) -> bool:
        assert not seq.block_table, "sequence already holds blocks"
        num_hit_blocks = len(hits) // self.num_groups
        # A fully cached prompt still needs its last token computed to get logits.
        num_computed = min(num_hit_blocks * self.block_size, seq.num_tokens - 1)
        num_new = min(seq.num_tokens - num_computed, max_new_tokens)
        fresh = max(self.blocks_for(num_computed + num_new) - num_hit_blocks, 0) * self.num_groups
        resurrected = sum(1 for b in hits if b != NO_BLOCK and self.blocks[b].ref_count == 0)
        if fresh + resurrected > self.num_free_blocks:
            return False
        for block_id in hits:
            seq.block_table.append(block_id)
            if block_id == NO_BLOCK:
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
                self.used_blocks.add(block_id)
                self.stats.resurrected_blocks += 1
            else:
                self.stats.shared_blocks += 1
            block.ref_count += 1
        seq.num_shared_kv_tokens = num_hit_blocks * self.block_size
        seq.num_hashed_blocks = num_hit_blocks if lookup else 0
        seq.hashed_prefix = self.blocks[hits[-1]].hash if lookup and hits else chain_start(seq)  # hits[-1]: a block
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
        taken) when the free blocks do not suffice. First, windowed groups hand back the blocks that lie behind
        the window of every position `seq` has left to compute (steps in flight run before any later step that
        could write into those blocks on the device)."""
        if self.num_groups > 1 or self.windows[0] is not None:
            self._release_behind_windows(seq, seq.num_computed_tokens + seq.num_inflight_tokens)
        missing = (self.blocks_for(num_tokens) - len(seq.block_table) // self.num_groups) * self.num_groups
        if missing > len(self.free_blocks):
            return False
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())
        return True

    def _release_behind_windows(self, seq: Sequence, first: int) -> None:
        """Hand back each windowed group's blocks wholly before `first`'s window (newest first, back to the last
        one handed back before)."""
        table, groups = seq.block_table, self.num_groups
        for group, window in enumerate(self.windows):
            if window is None:
                continue
            index = min((first - window + 1) // self.block_size, len(table) // groups) - 1
            while index >= 0 and table[index * groups + group] != NO_BLOCK:
                self._release(table[index * groups + group])
                table[index * groups + group] = NO_BLOCK
                index -= 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_blocks.remove(block_id)
            self.free_blocks[block_id] = None

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH:
            self._forget(block)
            self.stats.evictions += 1
        block.ref_count = 1
        self.used_blocks.add(block_id)
        return block_id

    def _forget(self, block: Block) -> None:
        """Drop a free block's hash: no later request finds it."""
        lookup = self.hash_to_block[block.group]
        if lookup.get(block.hash) == block.block_id:
            del lookup[block.hash]
        block.hash = NO_HASH
        block.token_ids = []

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks. Tail blocks go first into the queue, so they are evicted first."""
        for block_id in reversed(seq.block_table):
            if block_id != NO_BLOCK:
                self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_shared_kv_tokens = 0
        seq.num_hashed_blocks = 0
        seq.hashed_prefix = NO_HASH

    def reset_prefix_cache(self) -> None:
        """Drop the hashes of free blocks: later requests find only what running sequences hold."""
        for block_id in self.free_blocks:
            block = self.blocks[block_id]
            if block.hash != NO_HASH:
                self._forget(block)

    # ---- hashing as blocks fill ----------------------------------------------------------------------------

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Hash every block of `seq` whose tokens are all computed and committed (prefill chunks and decode
        alike)."""
        if not self.enable_prefix_caching:
            return
        groups, table = self.num_groups, seq.block_table
        num_full = min(seq.num_computed_tokens // self.block_size, len(table) // groups)
        prefix_hash = seq.hashed_prefix
        for index in range(seq.num_hashed_blocks, num_full):
            token_ids = seq.token_ids[index * self.block_size:(index + 1) * self.block_size]
            prefix_hash = self.hash_fn(prefix_hash, token_ids)
            for group in range(groups):
                block_id = table[index * groups + group]
                if block_id == NO_BLOCK:  # already behind its group's window
                    continue
                block = self.blocks[block_id]
                block.hash, block.token_ids, block.group = prefix_hash, token_ids, group
                self.hash_to_block[group].setdefault(prefix_hash, block_id)
        if num_full > seq.num_hashed_blocks:
            seq.num_hashed_blocks, seq.hashed_prefix = num_full, prefix_hash
