"""Engine-level logprobs and prompt logprobs against HF transformers' fp32 logits (docs/ARCHITECTURE.md).

The reference: one HF forward over prompt + generated tokens, log_softmax in float32; the logits at position p
score token p + 1. Every variant below must agree within 1e-4: chunked prefill (budget 16), prefix caching on
and off, a second pass that hits the prefix cache, the sync and the async loop."""
import gc
import math

import pytest
import torch
from reference import load_hf_model

from nanovllm import LLM, SamplingParams
from nanovllm.sampling_params import MAX_LOGPROBS

SHARED = list(range(200, 248))
PROMPTS = [SHARED + [5, 6, 7], [30, 31, 32], list(range(100, 170)), SHARED + list(range(300, 321)), [9]]
TOL = 1e-4


@torch.inference_mode()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """float32 [len - 1, vocab]: row p is log p(. | tokens[:p + 1]), which scores token p + 1."""
    logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_position(entry: dict, token_id: int, reference: torch.Tensor, k: int) -> None:
    """One position's {token id: Logprob}: the scored token's logprob and rank, and the top k."""
    assert entry[token_id].logprob == pytest.approx(float(reference[token_id]), abs=TOL)
    assert entry[token_id].rank == int((reference >= reference[token_id]).sum())
    top_values, top_ids = reference.topk(k)
    top = {tid: lp for tid, lp in entry.items() if lp.rank <= k}
    assert len(entry) in (k, k + 1)
    for rank, (tid, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), start=1):
        assert tid in top, f"rank {rank} token {tid} missing"
        assert top[tid].logprob == pytest.approx(value, abs=TOL)


def check_output(output, reference_model, params: SamplingParams) -> None:
    prompt, generated = output.prompt_token_ids, output.token_ids
    reference = hf_logprobs(reference_model, prompt + generated)
    if params.logprobs is not None:
        assert len(output.logprobs) == len(generated)
        total = 0.0
        for i, token_id in enumerate(generated):
            check_position(output.logprobs[i], token_id, reference[len(prompt) - 1 + i], params.logprobs)
            total += float(reference[len(prompt) - 1 + i, token_id])
        assert output.cumulative_logprob == pytest.approx(total, abs=TOL * len(generated))
    else:
        assert output.logprobs is None and output.cumulative_logprob is None
    if params.prompt_logprobs is not None:
        assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            check_position(output.prompt_logprobs[p], prompt[p], reference[p - 1], params.prompt_logprobs)
    else:
        assert output.prompt_logprobs is None


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dirs):
    return load_hf_model(tiny_model_dirs["qwen3"])


VARIANTS = {
    "prefix-on-budget-16": dict(enable_prefix_caching=True, max_num_batched_tokens=16),
    "prefix-off-budget-4096": dict(enable_prefix_caching=False, max_num_batched_tokens=4096),
    "prefix-on-budget-64-async": dict(enable_prefix_caching=True, max_num_batched_tokens=64, async_scheduling=True),
    "prefix-off-budget-16-async": dict(enable_prefix_caching=False, max_num_batched_tokens=16, async_scheduling=True),
}
# A mix in one batch: greedy and sampled rows, some asking, some not.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=10, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True, prompt_logprobs=5),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=MAX_LOGPROBS, prompt_logprobs=1),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logprobs_match_hf(variant, tiny_model_dirs, tiny_hf):
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=128, block_size=16,
              **VARIANTS[variant])
    for _ in range(2):  # the second pass finds the prompts in the prefix cache (when it is on)
        outputs = llm.generate(PROMPTS, PARAMS)
        for output, params in zip(outputs, PARAMS):
            check_output(output, tiny_hf, params)
    hits = [o.num_cached_tokens for o in outputs]
    if VARIANTS[variant]["enable_prefix_caching"]:
        assert hits[0] == 0 and hits[3] == 0, "rows asking prompt logprobs take no prefix-cache hits"
        assert hits[2] > 0, "the shared prompts hit the cache on the second pass"


def test_logprobs_under_preemption(tiny_model_dirs, tiny_hf):
    # 10 blocks of 16 tokens for five sequences: preemption recomputes prompts, logprobs stay exact.
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=160, num_kv_blocks=10, block_size=16)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, prompt_logprobs=2)] * 5
    outputs = llm.generate(PROMPTS, params)
    assert llm.get_metrics()["num_preemptions"] > 0
    for output, p in zip(outputs, params):
        check_output(output, tiny_hf, p)


def test_smollm_logprobs_match_hf(smollm_dir):
    llm = LLM(None, max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=32)
    reference_model = load_hf_model(smollm_dir)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5),
              SamplingParams(temperature=0.7, seed=1, max_tokens=8, ignore_eos=True, logprobs=2)]
    for output, p in zip(llm.generate(prompts, params), params):
        check_output(output, reference_model, p)
        assert all(isinstance(lp.decoded_token, str) for entry in output.logprobs for lp in entry.values())


def test_rows_without_logprobs_carry_none(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=64)
    output = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert output.logprobs is None and output.prompt_logprobs is None and output.cumulative_logprob is None
    assert llm._runner.persistent.rows.num_asking == 0


@pytest.mark.parametrize("field, value", [("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1), ("prompt_logprobs", 1.5),
                                          ("prompt_logprobs", True)])
def test_bad_logprob_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_cumulative_logprob_is_finite_for_sampled_rows(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=64)
    output = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.5, seed=2, max_tokens=16, ignore_eos=True,
                                                      logprobs=1))[0]
    assert math.isfinite(output.cumulative_logprob) and output.cumulative_logprob < 0


def test_tensor_parallel_logprobs_and_controls_equal_tp1(tiny_model_dirs):
    # TP=2 workers receive the prompt-logprob targets and run the chunked LM head with rank 0 (a collective).
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2,
                             repetition_penalty=1.5, logit_bias={17: 2.0}),
              SamplingParams(temperature=0.9, seed=4, max_tokens=6, ignore_eos=True, logprobs=1, n=2)]
    engine = dict(max_model_len=256, num_kv_blocks=64, block_size=16, max_num_batched_tokens=32)
    runs = []
    for tp in (1, 2):
        with LLM(str(tiny_model_dirs["qwen3"]), tensor_parallel_size=tp, async_scheduling=True, **engine) as llm:
            runs.append(llm.generate(PROMPTS[2:4], params))
    for one, two in zip(*runs):
        assert [c.token_ids for c in one.outputs] == [c.token_ids for c in two.outputs]
        assert one.cumulative_logprob == pytest.approx(two.cumulative_logprob, abs=1e-4)
        if one.prompt_logprobs is not None:
            assert [None if p is None else {t: lp.logprob for t, lp in p.items()} for p in one.prompt_logprobs] == [
                None if p is None else pytest.approx({t: lp.logprob for t, lp in p.items()}, abs=1e-4)
                for p in two.prompt_logprobs]


def test_token_texts_decode_each_id_once():
    """Logprob.decoded_token comes from TokenTexts: the tokenizer's text of the id alone, asked once per id."""
    from nanovllm.engine.logprob_records import TokenTexts

    class CountingTokenizer:
        calls: list[list[int]] = []

        def decode(self, ids):
            self.calls.append(list(ids))
            return "".join(f"<{i}>" for i in ids)

    tokenizer = CountingTokenizer()
    texts = TokenTexts(tokenizer)
    assert [texts(i) for i in (5, 7, 5, 5, 7, 9)] == ["<5>", "<7>", "<5>", "<5>", "<7>", "<9>"]
    assert tokenizer.calls == [[5], [7], [9]]


def test_recorded_logprobs_leave_no_objects_for_the_collector(tiny_model_dirs):
    """A job's logprobs are kept as one array chunk per step and references into it, which the garbage collector
    stops tracking: the objects it tracks after a run grow with the requests, not with the tokens (per-token
    lists once made every full collection of a long job slower: 0.6x of greedy throughput on the H100)."""
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=64)
    prompts = [list(range(10 + i, 50 + i)) for i in range(4)]

    def tracked_after(max_tokens: int) -> tuple[int, list]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5, prompt_logprobs=5)
        gc.collect()
        before = len(gc.get_objects())
        outputs = llm.generate(prompts, params)
        gc.collect()
        return len(gc.get_objects()) - before, outputs

    tracked_after(16), tracked_after(64)  # first-use objects (caches of new shapes) before counting
    short, _ = tracked_after(16)
    long, outputs = tracked_after(64)
    assert sum(len(o.logprobs) for o in outputs) == 4 * 64 and all(len(o.prompt_logprobs) == 40 for o in outputs)
    assert long - short < 48, f"{long - short} more tracked objects for 4 x 48 more positions"
    # built on access, in vLLM's shape, equal to a list of the same dictionaries
    first = outputs[0].logprobs
    assert first == list(first) and first[1:3] == [first[1], first[2]] and first[-1] == list(first)[-1]
    assert len(first[0]) in (5, 6) and first[0][outputs[0].token_ids[0]].rank == 1


def test_pickled_logprobs_carry_their_own_rows_and_texts(smollm_dir):
    """Data-parallel replicas send outputs through a pipe: one request's logprobs must not drag along every row of
    the steps it shared with others, nor the tokenizer."""
    import pickle

    llm = LLM(None, max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "SELECT * FROM",
               "The quick brown fox", "import numpy as np", "Dear Sir or Madam,", "1, 2, 3, 4,"]
    one = llm.generate(prompts[:1], params)[0]
    many = llm.generate(prompts, params)[0]  # the same request among seven others
    for output in (one, many):
        for positions in (output.logprobs, output.prompt_logprobs):
            copy = pickle.loads(pickle.dumps(positions))
            assert copy == positions and list(copy) == list(positions)
            assert all(p is None or all(isinstance(lp.decoded_token, str) for lp in p.values()) for p in copy)
    size = len(pickle.dumps(many.logprobs))
    assert size < 1.2 * len(pickle.dumps(one.logprobs)) and size < 24 * 400, size  # 24 positions of 4 ids or fewer
