"""End-to-end greedy decoding against HF transformers' own models, fp32 on the CPU (docs/ARCHITECTURE.md)."""
import pytest
import torch
from conftest import ARCH_CONFIGS
from helpers import model_prompt_logits
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


# ---- other architectures: Mistral, Gemma 2, Gemma 3, Phi-3, and the yarn / longrope rope types ------------------

# Prompts longer than the windows, up to 60 tokens (below longrope's switch), three sharing a 40-token prefix.
ARCH_SHARED = list(range(300, 340))
ARCH_PROMPTS = [ARCH_SHARED + [7, 8, 9], list(range(100, 160)), ARCH_SHARED + list(range(20, 39)), [5, 6], ARCH_SHARED]


@pytest.fixture(scope="module")
def arch_references(arch_model_dirs):
    return {arch: hf_greedy(load_hf_model(d, attn_implementation="eager"), ARCH_PROMPTS, MAX_NEW)
            for arch, d in arch_model_dirs.items()}


@pytest.mark.parametrize("variant", ["prefix-on-budget-16", "prefix-on-budget-4096"])
@pytest.mark.parametrize("arch", ARCH_CONFIGS)
def test_architectures_match_hf(arch, variant, arch_model_dirs, arch_references):
    """Greedy tokens equal HF's fp32 eager generation, in chunks of 16 tokens and whole; then again from the
    prefix cache (the shared prefix's full blocks, and every prompt's own blocks, are hits the second time)."""
    llm = LLM(str(arch_model_dirs[arch]), max_model_len=128, num_kv_blocks=64, block_size=16,
              **ENGINE_VARIANTS[variant])
    for attempt in range(2):
        outputs = llm.generate(ARCH_PROMPTS, GREEDY)
        assert [o.token_ids for o in outputs] == arch_references[arch], f"run {attempt}"
    assert outputs[1].num_cached_tokens == 48 and outputs[4].num_cached_tokens == 32


@pytest.mark.parametrize("arch", ["gemma2", "phi3-longrope"])
def test_architectures_match_hf_under_preemption(arch, arch_model_dirs, arch_references):
    # The memory of 8 blocks of 16 tokens over every layer for five sequences of up to 84 tokens: preempted
    # sequences recompute through windows. A model with several KV groups (kv_groups.py) has narrower blocks.
    from transformers import AutoConfig

    from nanovllm.kv_groups import plan_kv_groups
    from nanovllm.models.geometry import layer_windows

    config = AutoConfig.from_pretrained(str(arch_model_dirs[arch]))
    groups = plan_kv_groups(layer_windows(config))
    llm = LLM(str(arch_model_dirs[arch]), max_model_len=96, block_size=16, max_num_batched_tokens=32,
              num_kv_blocks=8 * config.num_hidden_layers // groups.width)
    outputs = llm.generate(ARCH_PROMPTS, GREEDY)
    assert llm.get_metrics()["num_preemptions"] > 0
    assert [o.token_ids for o in outputs] == arch_references[arch]


def test_window_spanning_the_whole_context_is_no_window():
    from transformers import AutoConfig

    from nanovllm.models.geometry import layer_windows

    config = AutoConfig.for_model("phi3", num_hidden_layers=2, max_position_embeddings=4096, sliding_window=4096)
    assert layer_windows(config) == (None, None)
    config.sliding_window = 2047
    assert layer_windows(config) == (2047, 2047)


def nanovllm_prompt_logits(directory, prompt: list[int], chunk: int) -> torch.Tensor:
    """Logits of every prompt position from our model loaded from `directory` (helpers.model_prompt_logits)."""
    from transformers import AutoConfig

    from nanovllm.loaders import load_safetensors_weights
    from nanovllm.models.registry import model_class_for

    hf_config = AutoConfig.from_pretrained(str(directory))
    model = model_class_for(hf_config)(hf_config).eval()
    load_safetensors_weights(model, directory)
    return model_prompt_logits(model, prompt, chunk)


@pytest.mark.parametrize("arch", ARCH_CONFIGS)
def test_architectures_logits_match_hf(arch, arch_model_dirs):
    prompt = list(range(100, 160))
    hf_model = load_hf_model(arch_model_dirs[arch], attn_implementation="eager")
    with torch.inference_mode():
        expected = hf_model(input_ids=torch.tensor([prompt])).logits[0]
    for chunk in (len(prompt), 7, 1):
        torch.testing.assert_close(nanovllm_prompt_logits(arch_model_dirs[arch], prompt, chunk), expected,
                                   rtol=1e-4, atol=1e-4)


def test_unsupported_architecture_fails_early_listing_supported(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel is not supported; supported: .*Gemma2ForCausalLM"):
        LLM(str(tmp_path))


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
