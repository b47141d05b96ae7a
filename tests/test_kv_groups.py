"""KV groups (kv_groups.py): how layers share blocks, and windowed groups handing back the blocks behind their
window in the block manager and the engine."""
import time

import pytest
from helpers import GraphSizes, make_seq

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.kv_groups import NO_BLOCK, max_blocks_held, plan_kv_groups

BS = 4
WINDOWS = (8, None)  # group 0: a sliding window of 8 positions; group 1: global


def test_layers_attending_alike_share_one_group_as_wide_as_the_model():
    for windows in ([None] * 4, [8] * 3):
        groups = plan_kv_groups(windows)
        assert groups.windows == (windows[0],) and groups.width == len(windows)
        assert groups.layer_slots == tuple((0, slot) for slot in range(len(windows)))


def test_interleaved_windows_make_groups_of_equal_width():
    gemma2 = plan_kv_groups([8, None] * 2)
    assert gemma2.windows == (8, None) and gemma2.width == 2
    assert gemma2.layer_slots == ((0, 0), (1, 0), (0, 1), (1, 1))
    # Gemma 3 1B: 26 layers, every sixth global. Width 4 leaves 2 of 28 slots empty (<= 10 %); width 2 none.
    windows = [None if layer % 6 == 5 else 512 for layer in range(26)]
    gemma3 = plan_kv_groups(windows)
    assert gemma3.width == 4 and gemma3.windows == (512,) * 6 + (None,)
    assert len(set(gemma3.layer_slots)) == 26
    assert all(gemma3.windows[group] == windows[layer] for layer, (group, _) in enumerate(gemma3.layer_slots))


def test_max_blocks_held_bounds_a_windowed_group_by_window_and_chunk():
    # 100 tokens in blocks of 16: the global group holds 7 blocks; the windowed one 7 positions behind a chunk
    # of 32, spanning at most ceil(39 / 16) + 1 = 4 blocks.
    assert max_blocks_held(WINDOWS, 100, 16, 32) == 7 + 4
    assert max_blocks_held((None,), 100, 16, 32) == 7
    assert max_blocks_held((8,), 20, 16, 32) == 2  # never more than the context's own blocks


def decode(bm: BlockManager, seq, until: int) -> None:
    """Compute `seq` one token per step, as the scheduler and runner would, until it has `until` computed."""
    while seq.num_computed_tokens < until:
        assert bm.try_grow(seq, seq.num_computed_tokens + 1)
        seq.start_step(1, True)
        seq.commit_step(1, 1000 + seq.num_tokens)
        bm.commit_computed_blocks(seq)


def prefill(bm: BlockManager, seq) -> None:
    assert bm.admit(seq, seq.num_tokens)
    num_new = seq.num_uncomputed_tokens
    seq.start_step(num_new, True)
    seq.commit_step(num_new, 1000 + seq.num_tokens)
    bm.commit_computed_blocks(seq)


def entries(seq, group: int) -> list[int]:
    return seq.block_table[group::len(WINDOWS)]


def test_windowed_group_hands_back_blocks_behind_its_window():
    bm = BlockManager(64, BS, windows=WINDOWS)
    seq = make_seq(list(range(12)), max_tokens=40)
    prefill(bm, seq)
    assert len(seq.block_table) == 2 * 3  # 12 tokens computed: 3 logical blocks, one per group each
    decode(bm, seq, 30)
    # The last growth check ran for position 29: its window starts at 22, so blocks 0..4 (positions < 20) went.
    assert entries(seq, 0)[:5] == [NO_BLOCK] * 5 and NO_BLOCK not in entries(seq, 0)[5:]
    assert NO_BLOCK not in entries(seq, 1)
    held = [b for b in seq.block_table if b != NO_BLOCK]
    assert len(bm.used_blocks) == len(held) and bm.num_free_blocks == 64 - len(held)
    bm.free(seq)
    assert bm.num_free_blocks == 64 and not bm.used_blocks


def test_prefix_hit_takes_only_the_window_blocks_a_windowed_group_needs():
    bm = BlockManager(64, BS, windows=WINDOWS)
    a = make_seq(list(range(24)))
    prefill(bm, a)
    b = make_seq(list(range(24)) + [99])
    hits = bm.match_prefix(b)
    # 6 full blocks hit; computing from position 24 on, the window reaches back to 17: blocks 4 and 5 only.
    assert hits[1::2] == entries(a, 1)[:6]
    assert hits[0::2] == [NO_BLOCK] * 4 + entries(a, 0)[4:6]
    assert bm.admit(b, 1) and b.num_computed_tokens == 24
    held = {block for block in hits if block != NO_BLOCK}
    assert all(bm.blocks[block].ref_count == 2 for block in held)


def test_prefix_hit_shrinks_to_what_the_windowed_group_still_holds():
    bm = BlockManager(64, BS, windows=WINDOWS)
    a = make_seq(list(range(24)))
    prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    window_block_5 = table[0::2][5]
    bm._forget(bm.blocks[window_block_5])  # as an eviction would
    hits = bm.match_prefix(make_seq(list(range(24)) + [99]))
    # 6 blocks would need block 5 of the windowed group; 5 blocks (from position 20: back to 13) need 3 and 4.
    assert len(hits) == 2 * 5
    assert hits[0::2] == [NO_BLOCK] * 3 + table[0::2][3:5]


def test_fork_shares_only_what_the_parent_still_holds():
    bm = BlockManager(64, BS, windows=WINDOWS)
    parent = make_seq(list(range(12)), max_tokens=40)
    prefill(bm, parent)
    early = make_seq(list(range(12)))
    assert bm.fork(parent, early, 12)
    # Computing from position 11 (the last prompt token, for its own logits), the window needs blocks 1 and 2.
    assert entries(early, 1)[:3] == entries(parent, 1)[:3]
    assert entries(early, 0)[:3] == [NO_BLOCK] + entries(parent, 0)[1:3]
    assert early.num_computed_tokens == 11
    decode(bm, parent, 30)  # the parent's window moved on: its prompt's windowed blocks are gone
    late = make_seq(list(range(12)))
    assert bm.fork(parent, late, 12)
    assert late.num_computed_tokens == 0 and not set(late.block_table) & set(parent.block_table)


def test_engine_memory_of_a_windowed_layer_stays_bounded(arch_model_dirs):
    llm = LLM(str(arch_model_dirs["gemma2"]), max_model_len=256, num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=32)
    manager = llm._block_manager
    assert manager.windows == (8, None)
    llm.add_request(list(range(1, 41)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    most_windowed = most_global = 0
    while llm.has_unfinished_requests():
        llm.step()
        for seq in llm._scheduler.running:
            most_windowed = max(most_windowed, sum(b != NO_BLOCK for b in seq.block_table[0::2]))
            most_global = max(most_global, sum(b != NO_BLOCK for b in seq.block_table[1::2]))
    # 240 tokens (239 computed): the global group grows to 15 blocks; the windowed group never holds more than
    # its window and a chunk reach (max_blocks_held), whatever the context.
    assert most_global == 15
    assert 2 <= most_windowed <= max_blocks_held((8,), 240, 16, 32) == 4


def test_prefix_lookup_stays_linear_when_windowed_blocks_are_gone():
    """A long prompt whose windowed group lacks its blocks (never cached, or evicted before the global group's):
    the lookup tries every shorter prefix, which must not rescan the prompt for each (it ran for seconds)."""
    num_tokens = 6000
    only_windowed = BlockManager(16, 1, windows=(8,))  # Mistral-like: every layer windowed, nothing cached
    interleaved = BlockManager(2 * num_tokens + 2, 1, windows=WINDOWS)
    first = make_seq(list(range(num_tokens)))
    prefill(interleaved, first)
    windowed_blocks = entries(first, 0)
    interleaved.free(first)
    for block in windowed_blocks:
        interleaved._forget(interleaved.blocks[block])  # as evictions would: the global group's blocks stay
    prompt = make_seq(list(range(num_tokens)) + [7])
    started = time.thread_time()  # this thread's CPU time: other processes and threads on the machine do not count
    assert only_windowed.match_prefix(prompt) == [] and interleaved.match_prefix(prompt) == []
    assert time.thread_time() - started < 1.0  # linear: ~0.05 s; one scan per prefix length: ~10 s


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_async_loop_equals_sync_loop_through_windows(arch, arch_model_dirs):
    """The async loop hands back windowed blocks while a step that reads them is in flight (and before it is
    committed, so they are never hashed): with prompts longer than the windows, in chunks of 16, and a second
    run served by the prefix cache, its greedy tokens equal the sync loop's."""
    prompts = [list(range(300, 340)) + [7, 8, 9], list(range(100, 160)), list(range(300, 340)), [5, 6]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(str(arch_model_dirs[arch]), max_model_len=128, num_kv_blocks=64, block_size=16,
                  max_num_batched_tokens=16, async_scheduling=async_scheduling)
        runs[async_scheduling] = [[o.token_ids for o in llm.generate(prompts, params)] for _ in range(2)]
        assert llm.get_metrics()["prefix_cache"]["hit_tokens"] > 0
    assert runs[True] == runs[False] and runs[False][0] == runs[False][1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sibling_completions_through_windows_equal_a_single_one(async_scheduling, arch_model_dirs):
    """n > 1 on interleaved windows: siblings fork from the parent's prompt blocks as far as its windowed group
    still holds them (a 60-token prompt, windows of 8) and each decodes what a single completion does."""
    llm = LLM(str(arch_model_dirs["gemma2"]), max_model_len=128, num_kv_blocks=64, block_size=16,
              max_num_batched_tokens=32, enable_prefix_caching=False, async_scheduling=async_scheduling)
    prompt = list(range(100, 160))
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    llm.reset_stats()
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=3))[0]
    assert all(c.token_ids == single.token_ids for c in output.outputs)
    # Each sibling shares the three full blocks (the windowed group only the third) and computes 12 tokens.
    assert llm.stats.prefill_tokens == len(prompt) + 2 * 12
    assert llm._block_manager.num_free_blocks == 64


def test_decode_graphs_take_a_new_block_per_row_and_group(arch_model_dirs):
    """Three 16-token prompts of a model with two KV groups all start their second block in the same decode step:
    six table updates. A graph of 4 rows carries 4 x 2 update slots, so the step still replays a graph (it ran
    eagerly when a graph carried one update per row)."""
    llm = LLM(str(arch_model_dirs["gemma2"]), max_model_len=256, num_kv_blocks=64, block_size=16)
    for i in range(3):
        llm.add_request(list(range(20 * i + 1, 20 * i + 17)), SamplingParams(temperature=0, max_tokens=4))
    llm.step()  # the prefills
    runner = llm._runner
    runner.graphs = GraphSizes()
    batch = llm._scheduler.schedule()
    assert batch.num_tokens == len(batch) and runner.num_groups == 2  # a pure decode step
    inputs = runner.prepare(batch)
    assert inputs.graph_size == 4 and inputs.table_updates.shape == (2, 8)
    real = [(i, b) for i, b in zip(*inputs.table_updates.tolist()) if i != runner.tables.sink_index]
    assert len(real) == 6 and {b for _, b in real} == {b for seq in batch.seqs for b in seq.block_table[2:4]}
