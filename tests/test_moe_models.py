"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against HF transformers'
own implementations, fp32 on the CPU: greedy tokens through the engine (prefix cache, chunked prefill, tensor
parallelism), logits of a forward pass, the fused path's wiring, loading and the model registry."""
import json

import pytest
import torch
from conftest import PRESETS, save_random_hf_model
from reference import hf_greedy, load_hf_model
from test_engine_hf import ENGINE_VARIANTS, GREEDY, MAX_NEW, TINY_PROMPTS

from nanovllm import LLM
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend
from nanovllm.layers.moe import SparseMoeBlock
from nanovllm.loaders import load_dummy_weights, load_safetensors_weights
from nanovllm.models.geometry import head_dim_of
from nanovllm.models.llama import LlamaMLP
from nanovllm.models.registry import MODEL_CLASSES, model_class_for

MOE_PRESETS = ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-moe")
    return {p: save_random_hf_model(p, root / p) for p in MOE_PRESETS}


@pytest.fixture(scope="module")
def moe_references(moe_dirs):
    return {p: hf_greedy(load_hf_model(d), TINY_PROMPTS, MAX_NEW) for p, d in moe_dirs.items()}


def preset_config(preset: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(**json.loads((PRESETS / f"{preset}.json").read_text()))


@pytest.mark.parametrize("variant", ["prefix-on-budget-16", "prefix-on-budget-4096", "prefix-off-budget-64"])
@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_greedy_tokens_match_hf(preset, variant, moe_dirs, moe_references):
    llm = LLM(str(moe_dirs[preset]), max_model_len=256, num_kv_blocks=128, block_size=16, **ENGINE_VARIANTS[variant])
    outputs = llm.generate(TINY_PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == moe_references[preset]
    if ENGINE_VARIANTS[variant]["enable_prefix_caching"]:
        again = llm.generate(TINY_PROMPTS, GREEDY)
        assert [o.token_ids for o in again] == moe_references[preset]
        assert again[2].num_cached_tokens == 64  # 70-token prompt: four full blocks from the first run


def test_the_layer_layout_follows_the_config():
    """Qwen3-MoE: `mlp_only_layers` [1] is dense; Qwen2-MoE: decoder_sparse_step 2 makes layer 1 sparse only,
    with a shared expert; Mixtral: every layer sparse."""
    kinds = {}
    for preset in MOE_PRESETS:
        with torch.device("meta"):
            model = model_class_for(preset_config(preset))(preset_config(preset))
        kinds[preset] = [type(layer.mlp).__name__ for layer in model.model.layers]
        if preset == "tiny-qwen2-moe":
            assert isinstance(model.model.layers[1].mlp.shared_expert, LlamaMLP)
    assert kinds == {"tiny-qwen3-moe": ["SparseMoeBlock", "LlamaMLP", "SparseMoeBlock"],
                     "tiny-qwen2-moe": ["LlamaMLP", "SparseMoeBlock"],
                     "tiny-mixtral": ["SparseMoeBlock", "SparseMoeBlock"]}


def _forward_logits(model, config, ids: torch.Tensor) -> torch.Tensor:
    """All positions' logits of one prompt through `model` with the torch attention backend and a fresh cache."""
    num_tokens, block_size = len(ids), 16
    num_blocks = -(-num_tokens // block_size)
    for layer in model.attention_layers():
        layer.k_cache, layer.v_cache = torch.zeros(2, num_blocks, block_size, config.num_key_value_heads,
                                                   head_dim_of(config)).unbind(0)
        layer.backend = TorchAttentionBackend()
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens), query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], max_query_len=num_tokens,
        max_seq_len=num_tokens)
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(num_tokens), meta))


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_logits_match_hf(preset, moe_dirs):
    hf = load_hf_model(moe_dirs[preset])
    config = hf.config
    model = model_class_for(config)(config)
    load_safetensors_weights(model, moe_dirs[preset])
    ids = torch.tensor(TINY_PROMPTS[2])
    logits = _forward_logits(model, config, ids)
    with torch.inference_mode():
        expected = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_fused_path_matches_the_torch_path(preset):
    """The wiring of the fused MoE (and the other fused ops) inside the model: same weights, same logits."""
    config = preset_config(preset)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    logits, weights = [], None
    for fused in (False, True):
        model = model_class_for(config)(config, fused_ops=fused)
        if weights is None:
            load_dummy_weights(model, seed=1)
            weights = model.state_dict()
        model.load_state_dict(weights)
        logits.append(_forward_logits(model, config, ids))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_tensor_parallel_experts_match_hf(moe_dirs, moe_references):
    """TP=2 (gloo): each rank loads half of every expert's intermediate dimension (and of the shared expert);
    one all-reduce per MoE block."""
    with LLM(str(moe_dirs["tiny-qwen2-moe"]), tensor_parallel_size=2, max_model_len=256, num_kv_blocks=128,
             max_num_batched_tokens=32) as llm:
        outputs = llm.generate(TINY_PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == moe_references["tiny-qwen2-moe"]


def test_dummy_weights_fill_every_expert():
    llm = LLM("tiny-mixtral", load_format="dummy", max_model_len=128, num_kv_blocks=16)
    blocks = [m for m in llm._runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 2
    for block in blocks:
        for param in (block.experts.gate_up_proj, block.experts.down_proj):
            assert param.abs().amax(dim=(1, 2)).min() > 0  # no expert left empty
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == MAX_NEW


def test_a_missing_expert_tensor_is_named(moe_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    source = moe_dirs["tiny-mixtral"]
    tensors = {}
    for file in source.glob("*.safetensors"):
        tensors.update(load_file(file))
    del tensors["model.layers.1.block_sparse_moe.experts.6.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    config = preset_config("tiny-mixtral")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj \(15 of 16 expert"):
        load_safetensors_weights(model_class_for(config)(config), tmp_path)


def test_registry_names_what_it_supports():
    config = preset_config("tiny-qwen3-moe")
    config.architectures = ["DeepseekV3ForCausalLM"]
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM is not supported; supported: .*MixtralForCausalLM.*"
                                         "Qwen3MoeForCausalLM"):
        model_class_for(config)
    assert model_class_for(preset_config("tiny-llama")) is MODEL_CLASSES["LlamaForCausalLM"]  # by model_type


def test_unsupported_moe_settings_fail_early():
    config = preset_config("tiny-mixtral")
    config.num_experts_per_tok = 9
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        model_class_for(config)(config)
    with pytest.raises(ValueError, match="moe_intermediate_size=32"):
        LLM("tiny-qwen3-moe", load_format="dummy", tensor_parallel_size=3)
