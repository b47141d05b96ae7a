import numpy as np
import xxhash
from helpers import make_seq

from nanovllm.engine.block_manager import NO_HASH, BlockManager, compute_block_hash

BS = 4


def admit(bm: BlockManager, seq, num_new: int | None = None):
    hits = bm.match_prefix(seq)
    assert bm.admit(seq, num_new if num_new is not None else seq.num_tokens)
    return hits


def compute(bm: BlockManager, seq, num_tokens: int | None = None):
    """Pretend the runner computed the sequence's tokens, then hash what filled."""
    num_new = (seq.num_tokens if num_tokens is None else num_tokens) - seq.num_computed_tokens
    seq.start_step(num_new, samples=False)
    seq.commit_step(num_new, None)
    bm.commit_computed_blocks(seq)


def test_hash_chain_matches_definition():
    first = list(range(BS))
    second = list(range(BS, 2 * BS))
    h1 = xxhash.xxh64(np.array(first, dtype=np.int64).tobytes()).intdigest()
    h2 = xxhash.xxh64(h1.to_bytes(8, "little") + np.array(second, dtype=np.int64).tobytes()).intdigest()
    assert compute_block_hash(NO_HASH, first) == h1
    assert compute_block_hash(h1, second) == h2
    # the same tokens after a different prefix hash differently
    assert compute_block_hash(compute_block_hash(NO_HASH, [9] * BS), second) != h2


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(10)))
    admit(bm, a)
    compute(bm, a)
    b = make_seq(list(range(8)) + [99, 98, 97])
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    assert b.block_table[2] != a.block_table[2]
    assert bm.stats.shared_blocks == 2 and bm.stats.hit_tokens == 8
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in hits] == [1, 1]
    assert all(i in bm.used_blocks for i in hits)


def test_first_miss_ends_reuse():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(12)))
    admit(bm, a)
    compute(bm, a)
    b = make_seq([0, 1, 2, 3, 7, 7, 7, 7] + list(range(8, 12)) + [5])  # block 1 differs, block 2 equal to a's
    assert bm.match_prefix(b) == a.block_table[:1]


def test_collision_with_different_tokens_is_a_miss():
    bm = BlockManager(16, BS, hash_fn=lambda prefix, tokens: 42)  # every block hashes alike
    a = make_seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute(bm, a)
    b = make_seq([4, 3, 2, 1, 5])
    assert bm.match_prefix(b) == []
    c = make_seq([1, 2, 3, 4, 6])
    assert bm.match_prefix(c) == a.block_table[:1]


def test_freed_block_keeps_hash_and_is_resurrected():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)))
    admit(bm, a)
    compute(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert all(bm.blocks[i].hash != NO_HASH for i in table[:2])
    b = make_seq(list(range(9)))
    hits = admit(bm, b, 1)
    assert bm.num_free_blocks == 8 - 3  # two resurrected + one fresh
    assert hits == table[:2]
    assert b.num_computed_tokens == 8
    assert bm.stats.resurrected_blocks == 2
    assert all(i in bm.used_blocks and i not in bm.free_blocks for i in hits)


def test_eviction_takes_oldest_free_block_and_drops_its_hash():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(8)))
    admit(bm, a)
    compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)  # tail first: a's block 1 then block 0 go to the back of the queue
    order = list(bm.free_blocks)
    assert order[-2:] == [a_blocks[1], a_blocks[0]]
    c = make_seq(list(range(100, 111)))  # needs 3 fresh blocks: two never-used ones, then a's block 1
    admit(bm, c)
    assert c.block_table == order[:3]
    assert bm.stats.evictions == 1
    assert bm.blocks[a_blocks[1]].hash == NO_HASH
    assert bm.match_prefix(make_seq(list(range(8)))) == a_blocks[:1]


def test_fully_cached_prompt_recomputes_last_token_without_rewriting_it():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(8)))
    admit(bm, a)
    compute(bm, a)
    b = make_seq(list(range(8)))
    hits = admit(bm, b)
    assert len(hits) == 2
    assert b.num_computed_tokens == 7 and b.num_uncomputed_tokens == 1
    assert b.num_shared_kv_tokens == 8  # the last token's KV is already in the shared block: no write


def test_blocks_are_hashed_as_decode_fills_them():
    bm = BlockManager(8, BS)
    a = make_seq([1, 2, 3])
    admit(bm, a)
    compute(bm, a)
    assert bm.blocks[a.block_table[0]].hash == NO_HASH
    a.token_ids.append(4)  # decode: token 4 is sampled, then computed in the next step
    assert bm.try_grow(a, 4)
    compute(bm, a)
    assert bm.blocks[a.block_table[0]].hash == compute_block_hash(NO_HASH, [1, 2, 3, 4])
    b = make_seq([1, 2, 3, 4, 5])
    assert bm.match_prefix(b) == a.block_table[:1]


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(8)))
    admit(bm, a)
    compute(bm, a)
    assert bm.match_prefix(make_seq(list(range(9)))) == []
    assert all(b.hash == NO_HASH for b in bm.blocks)


def test_admission_and_growth_take_nothing_when_blocks_run_short():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(9)))  # 3 blocks
    admit(bm, a)
    b = make_seq(list(range(100, 109)))
    assert not bm.admit(b, b.num_tokens) and b.block_table == [] and b.num_computed_tokens == 0
    assert bm.admit(b, 4) and len(b.block_table) == 1  # a first chunk of 4 tokens fits in the last block
    assert not bm.try_grow(b, 5) and len(b.block_table) == 1 and bm.num_free_blocks == 0
    bm.free(a)
    assert bm.try_grow(b, 9) and len(b.block_table) == 3


def test_every_block_is_in_exactly_one_set():
    bm = BlockManager(6, BS)
    seqs = [make_seq(list(range(i, i + 7))) for i in range(3)]
    for s in seqs:
        admit(bm, s)
        compute(bm, s)
    bm.free(seqs[1])
    assert bm.used_blocks.isdisjoint(bm.free_blocks)
    assert bm.used_blocks | set(bm.free_blocks) == set(range(6))
