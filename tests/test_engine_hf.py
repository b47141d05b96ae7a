"""End-to-end greedy decoding against HF transformers' own models, fp32 on the CPU (docs/ARCHITECTURE.md)."""
import pytest
from reference import hf_greedy, load_hf_model

from nanovllm import LLM, SamplingParams

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)

# Ragged prompts; several share a 48-token prefix so the prefix cache has something to find.
SHARED = list(range(200, 248))
TINY_PROMPTS = [
    SHARED + [5, 6, 7],
    [30, 31, 32],
    list(range(100, 170)),
    SHARED + list(range(300, 321)),
    [9],
    SHARED,
]

ENGINE_VARIANTS = {
    "prefix-on-budget-16": dict(enable_prefix_caching=True, max_num_batched_tokens=16),
    "prefix-on-budget-64": dict(enable_prefix_caching=True, max_num_batched_tokens=64),
    "prefix-on-budget-4096": dict(enable_prefix_caching=True, max_num_batched_tokens=4096),
    "prefix-off-budget-16": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
    "prefix-off-budget-64": dict(enable_prefix_caching=False, max_num_batched_tokens=64),
    "prefix-off-budget-4096": dict(enable_prefix_caching=False, max_num_batched_tokens=4096),
}


@pytest.fixture(scope="module")
def tiny_references(tiny_model_dirs):
    return {t: hf_greedy(load_hf_model(d), TINY_PROMPTS, MAX_NEW) for t, d in tiny_model_dirs.items()}


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_tiny_models_match_hf(model_type, variant, tiny_model_dirs, tiny_references):
    llm = LLM(str(tiny_model_dirs[model_type]), max_model_len=256, num_kv_blocks=128, block_size=16,
              **ENGINE_VARIANTS[variant])
    outputs = llm.generate(TINY_PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == tiny_references[model_type]
    assert all(o.finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_tiny_models_match_hf_under_preemption(model_type, tiny_model_dirs, tiny_references):
    # 10 blocks of 16 tokens for six sequences of up to 94 tokens each: the scheduler must preempt and recompute.
    llm = LLM(str(tiny_model_dirs[model_type]), max_model_len=160, num_kv_blocks=10, block_size=16)
    outputs = llm.generate(TINY_PROMPTS, GREEDY)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert [o.token_ids for o in outputs] == tiny_references[model_type]


def test_second_run_hits_prefix_cache_with_identical_output(tiny_model_dirs, tiny_references):
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=256, num_kv_blocks=128, block_size=16)
    first = llm.generate(TINY_PROMPTS, GREEDY)
    second = llm.generate(TINY_PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == tiny_references["qwen3"]
    assert all(o.num_cached_tokens > 0 for o in second if o.num_prompt_tokens > 16)
    assert second[2].num_cached_tokens == 64  # 70-token prompt: four full blocks
    assert second[5].num_cached_tokens == 47  # fully cached 48-token prompt recomputes its last token
    assert llm.get_metrics()["prefix_cache"]["hit_tokens"] > 0


# ---- the embedded SmolLM2 (from its GGUF) ---------------------------------------------------------------------

SYSTEM = ("You are a meticulous assistant for a small engineering team. Answer briefly and precisely, prefer "
          "concrete numbers, and say when you are unsure.")
CHATS = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three prime numbers."}],
    [{"role": "user", "content": "Write a haiku about autumn."}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does zip() do in Python?"}],
]


@pytest.fixture(scope="module")
def smollm_case(smollm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_dir))
    prompts = [tokenizer(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False).input_ids for c in CHATS]
    return prompts, hf_greedy(load_hf_model(smollm_dir), prompts, MAX_NEW)


@pytest.mark.parametrize("variant", ["prefix-on-budget-16", "prefix-on-budget-4096", "prefix-off-budget-64"])
def test_smollm2_gguf_matches_hf(variant, smollm_case):
    prompts, reference = smollm_case
    llm = LLM(None, max_model_len=512, num_kv_blocks=64, **ENGINE_VARIANTS[variant])
    outputs = llm.chat(CHATS, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.token_ids for o in outputs] == reference
    if ENGINE_VARIANTS[variant]["enable_prefix_caching"]:
        again = llm.chat(CHATS, GREEDY)
        assert [o.token_ids for o in again] == reference
        assert all(o.num_cached_tokens >= 16 for o in again)


def test_smollm2_under_preemption(smollm_case):
    prompts, reference = smollm_case
    llm = LLM(None, max_model_len=128, num_kv_blocks=8, block_size=16, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, GREEDY)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert [o.token_ids for o in outputs] == reference
