"""n and best_of: sibling completions share the prompt's KV blocks (BlockManager.fork), each with its own seed."""
import pytest

from nanovllm import LLM, SamplingParams

PROMPT = list(range(100, 140))  # 40 tokens: two full 16-token blocks and a partial one
BLOCK = 16


@pytest.fixture(scope="module", params=["sync", "async"])
def llm(request, tiny_model_dirs):
    return LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=64, block_size=BLOCK,
               enable_prefix_caching=False, async_scheduling=request.param == "async")


def test_siblings_share_the_prompt_blocks(llm):
    llm.reset_stats()
    llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=4), request_id="r")
    outputs = []
    shared_seen = False
    while llm.has_unfinished_requests():
        outputs += llm.step()
        running = [s for s in llm._scheduler.running if s.request_id == "r"]
        if len(running) == 4:
            tables = [s.block_table for s in running]
            assert all(t[:2] == tables[0][:2] for t in tables)  # the two full prompt blocks, shared
            assert len({t[2] for t in tables}) == 4  # the partial one recomputed into each own block
            assert all(llm._block_manager.blocks[b].ref_count == 4 for b in tables[0][:2])
            shared_seen = True
    assert shared_seen
    assert len(outputs) == 1 and len(outputs[0].outputs) == 4
    # one prefill of 40 tokens plus the three siblings' recomputed partial block (8 tokens each)
    assert llm.stats.prefill_tokens == len(PROMPT) + 3 * (len(PROMPT) % BLOCK)


def test_siblings_waiting_for_their_prompt_do_not_hold_back_the_requests_behind_them(llm):
    """A stream of n > 1 requests: the first step admits every request's first completion, not only the first
    request's (its siblings wait for their prompt without blocking the queue), and each prompt is still computed
    once, its siblings forked onto it."""
    llm.reset_stats()
    prompts = [[t + 50 * i for t in PROMPT] for i in range(3)]
    for i, prompt in enumerate(prompts):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=4), request_id=f"r{i}")
    outputs = llm.step()
    assert {s.request_id for s in llm._scheduler.running} == {"r0", "r1", "r2"}
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
    assert all(len(o.outputs) == 4 for o in outputs)
    assert llm.stats.prefill_tokens == 3 * (len(PROMPT) + 3 * (len(PROMPT) % BLOCK))


def test_a_waiting_sibling_keeps_its_seat_for_its_fork(tiny_model_dirs):
    """With seats for two rows, a request of n 2 and one behind it: the rows behind the waiting sibling do not
    take its seat, so it forks onto the computed prompt (one prefill of it, plus its partial block) instead of
    waiting for the parent to finish and computing the prompt again."""
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=64, block_size=BLOCK,
              enable_prefix_caching=False, max_num_seqs=2)
    llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2), request_id="a")
    other = [t + 50 for t in PROMPT]
    llm.add_request(other, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), request_id="b")
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert [o.request_id for o in outputs] == ["a", "b"]
    assert llm.stats.prefill_tokens == len(PROMPT) + len(PROMPT) % BLOCK + len(other)


def test_greedy_n_gives_identical_completions(llm):
    single = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    output = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=4))[0]
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == single.token_ids for c in output.outputs)
    assert output.token_ids == single.token_ids and output.text == single.text


def test_seeded_n_is_reproducible_and_each_completion_has_its_seed(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, n=3)
    first, again = (llm.generate([PROMPT], params)[0] for _ in range(2))
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    for index, completion in enumerate(first.outputs):  # completion i draws with seed + i
        alone = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=5 + index, max_tokens=12,
                                                      ignore_eos=True))[0]
        assert completion.token_ids == alone.token_ids


def test_best_of_keeps_the_highest_cumulative_logprob(llm):
    every = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=9, max_tokens=10, ignore_eos=True, n=5,
                                                  logprobs=0))[0].outputs
    best = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=9, max_tokens=10, ignore_eos=True, n=2,
                                                 best_of=5))[0]
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in best.outputs)  # not asked for


@pytest.mark.parametrize("field, value", [("n", 0), ("n", -1), ("best_of", 1), ("n", 1000)])
def test_bad_n_values_name_the_field(field, value):
    kwargs = {"n": 2, field: value} if field == "best_of" else {field: value}
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**kwargs)
