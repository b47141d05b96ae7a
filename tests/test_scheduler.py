from helpers import make_seq

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import SequenceStatus

BS = 4
EOS = 2


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=64, max_model_len=256, prefix=True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=prefix)
    return Scheduler(bm, max_num_seqs, budget, max_model_len, {EOS})


def step(sched, token=7):
    batch = sched.schedule()
    planned = list(zip([s.seq_id for s in batch.seqs], batch.num_new_tokens))
    sched.postprocess(batch, [token] * len(batch))
    return batch, planned


def test_token_budget_and_chunking_of_long_prompt():
    sched = make_scheduler(budget=16)
    long = make_seq(list(range(100, 140)), max_tokens=2)  # 40 tokens: chunks 16, 16, 8
    sched.add(long)
    chunks = [step(sched)[1] for _ in range(3)]
    assert chunks == [[(long.seq_id, 16)], [(long.seq_id, 16)], [(long.seq_id, 8)]]
    assert long.num_output_tokens == 1  # only the last chunk produced a token
    assert long.num_computed_tokens == 40


def test_mixed_batch_decode_first_then_prefill_chunk():
    sched = make_scheduler(budget=10)
    a = make_seq([1, 3, 4], max_tokens=5)
    sched.add(a)
    step(sched)
    b = make_seq(list(range(10, 30)), max_tokens=5)
    sched.add(b)
    batch, planned = step(sched)
    assert planned == [(a.seq_id, 1), (b.seq_id, 9)]
    assert batch.num_tokens == 10 and batch.num_tokens != len(batch)  # not a pure decode step


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq([5 + i, 6, 7], max_tokens=3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    _, planned = step(sched)
    assert [p[0] for p in planned] == [seqs[0].seq_id, seqs[1].seq_id]
    assert seqs[2].status is SequenceStatus.WAITING


def test_stop_conditions_and_blocks_freed():
    sched = make_scheduler()
    a = make_seq([1, 3], max_tokens=3)
    b = make_seq([1, 4], max_tokens=10)
    c = make_seq([1, 5], max_tokens=10, stop_token_ids=[9], ignore_eos=True)
    d = make_seq([1, 6], max_tokens=10, ignore_eos=True)
    for s in (a, b, c, d):
        sched.add(s)
    step(sched, token=7)
    step(sched, token=7)
    step(sched, token=7)  # a hits max_tokens
    assert a.finish_reason == "length" and a.num_output_tokens == 3 and a.block_table == []
    step(sched, token=EOS)  # b stops at EOS, d ignores it
    assert b.finish_reason == "stop" and d.status is SequenceStatus.RUNNING
    step(sched, token=9)
    assert c.finish_reason == "stop" and c.output_token_ids[-1] == 9


def test_max_model_len_stops_with_length():
    sched = make_scheduler(max_model_len=6)
    a = make_seq([1, 3, 4, 5], max_tokens=100)
    sched.add(a)
    for _ in range(3):
        step(sched)
    assert a.finish_reason == "length" and a.num_tokens == 6


def test_preemption_frees_latest_and_resumes_by_recompute():
    sched = make_scheduler(num_blocks=4, budget=64)
    a = make_seq([1, 3, 4, 5, 6, 7, 8, 9], max_tokens=8, ignore_eos=True)  # 2 full blocks
    b = make_seq([11, 13, 14, 15, 16, 17, 18, 19], max_tokens=8, ignore_eos=True)  # 2 full blocks
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled; the token each sampled needs a third block
    assert sched.block_manager.num_free_blocks == 0
    _, planned = step(sched)  # a needs a third block: b (latest) is preempted
    assert planned == [(a.seq_id, 1)]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_preemptions == 1
    assert sched.waiting[0] is b
    while a.status is not SequenceStatus.FINISHED:
        step(sched)
    assert a.num_output_tokens == 8
    # b comes back: its prompt and the token it had are recomputed (prefix hits where blocks survived)
    tokens_before = list(b.token_ids)
    _, planned = step(sched)
    assert planned[0][0] == b.seq_id and b.token_ids[:len(tokens_before)] == tokens_before
    while b.status is not SequenceStatus.FINISHED:
        step(sched)
    assert b.num_output_tokens == 8


def test_request_that_can_never_fit_is_reported():
    sched = make_scheduler(num_blocks=4, max_model_len=100)
    too_long = make_seq(list(range(10)), max_tokens=20)  # up to 30 tokens = 8 blocks > 4
    assert "KV blocks" in sched.capacity_error(too_long)
    prompt_too_long = make_seq(list(range(100)), max_tokens=1)
    assert "max_model_len" in sched.capacity_error(prompt_too_long)
    fits = make_seq(list(range(10)), max_tokens=6)
    assert sched.capacity_error(fits) is None


def test_waiting_request_without_room_waits_instead_of_failing():
    sched = make_scheduler(num_blocks=4, budget=64)
    a = make_seq(list(range(1, 13)), max_tokens=4, ignore_eos=True)  # 3 blocks, grows into the 4th
    b = make_seq(list(range(20, 28)), max_tokens=2, ignore_eos=True)  # 2 blocks: must wait for a
    sched.add(a)
    sched.add(b)
    _, planned = step(sched)
    assert planned == [(a.seq_id, 12)]
    while a.status is not SequenceStatus.FINISHED:
        step(sched)
    while b.status is not SequenceStatus.FINISHED:
        step(sched)
    assert b.num_output_tokens == 2


def test_batch_carries_input_ids_and_the_sequences_whose_tables_changed():
    sched = make_scheduler(budget=10)
    a = make_seq([1, 3, 4], max_tokens=5)  # 3 tokens: one block of 4, the 4th token still fits
    sched.add(a)
    batch = sched.schedule()
    assert batch.input_ids == [1, 3, 4] and batch.table_changed == [a]  # admitted: its whole table is new
    sched.postprocess(batch, [9])
    b = make_seq(list(range(10, 20)), max_tokens=5)
    sched.add(b)
    batch = sched.schedule()  # a decodes its 4th token in its first block; b's first chunk of 9 tokens
    assert batch.input_ids == [9] + list(range(10, 19))
    assert batch.table_changed == [b]
    sched.postprocess(batch, [8, 0])
    batch = sched.schedule()  # a's 5th token needs a second block; b's last prompt token fits its third
    assert batch.input_ids == [8, 19] and batch.table_changed == [a]


def test_batch_counts_prompt_tokens_as_prefill():
    sched = make_scheduler(budget=10)
    a = make_seq([1, 3, 4], max_tokens=5)
    sched.add(a)
    first = sched.schedule()
    assert first.num_prefill_tokens == 3
    sched.postprocess(first, [9])
    sched.add(make_seq(list(range(10, 20)), max_tokens=5))
    second = sched.schedule()  # a's decode token + a 9-token prompt chunk
    assert (second.num_tokens, second.num_prefill_tokens) == (10, 9)
