"""Rotary tables against transformers' own rope initialisers (ROPE_INIT_FUNCTIONS: inverse frequencies and the
attention factor) for every rope type we support, plus the longrope switch rule."""
import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm.layers.rotary import RotaryEmbedding, rope_parameters

HEAD_DIM = 32
MAX_POSITION = 512


def hf_config(model_type: str = "llama", **kwargs):
    return AutoConfig.for_model(model_type, hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM,
                                max_position_embeddings=MAX_POSITION, **kwargs)


def hf_table(config, seq_len: int | None = None, layer_type: str | None = None) -> torch.Tensor:
    """cos | sin of every position from HF's inverse frequencies and attention factor."""
    params = rope_parameters(config, layer_type)
    init = ROPE_INIT_FUNCTIONS.get(params["rope_type"])  # transformers 5 has no entry for plain rope
    if init is None:
        dim = int(HEAD_DIM * params["partial_rotary_factor"])
        inv_freq = 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        attention = 1.0
    else:
        kwargs = {"seq_len": seq_len} if seq_len is not None else {}
        if layer_type is not None:
            kwargs["layer_type"] = layer_type
        inv_freq, attention = init(config, torch.device("cpu"), **kwargs)
    freqs = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float), inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
CASES = {
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 3.0}),
    "llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn": dict(rope_scaling=YARN),
    "yarn-betas-no-truncate": dict(rope_scaling={**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False}),
    "yarn-mscale": dict(rope_scaling={**YARN, "mscale": 0.8, "mscale_all_dim": 0.5}),
    "yarn-attention-factor": dict(rope_scaling={**YARN, "attention_factor": 1.25}),
    "yarn-qwen3": dict(model_type="qwen3", rope_scaling=YARN),
}


@pytest.mark.parametrize("case", CASES)
def test_rope_types_match_hf(case):
    kwargs = dict(CASES[case])
    config = hf_config(kwargs.pop("model_type", "llama"), **kwargs)
    ours = RotaryEmbedding(HEAD_DIM, MAX_POSITION, rope_parameters(config)).cos_sin
    torch.testing.assert_close(ours, hf_table(config), rtol=1e-5, atol=1e-5)


def test_longrope_switches_to_long_factors_at_the_original_context():
    short = [1.0 + 0.1 * i for i in range(HEAD_DIM // 4)]
    long = [2.0 + 0.5 * i for i in range(HEAD_DIM // 4)]
    config = hf_config("phi3", original_max_position_embeddings=128, partial_rotary_factor=0.5,
                       rope_scaling={"rope_type": "longrope", "short_factor": short, "long_factor": long})
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, rope_parameters(config))
    assert rotary.rotary_dim == HEAD_DIM // 2
    short_table, long_table = hf_table(config, seq_len=128), hf_table(config, seq_len=129)
    assert not torch.allclose(short_table[200], long_table[200])
    torch.testing.assert_close(rotary.cos_sin[:128], short_table[:128], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotary.cos_sin[128:], long_table[128:], rtol=1e-5, atol=1e-5)


def test_partial_rotary_passes_the_other_dims_through():
    config = hf_config("phi3", partial_rotary_factor=0.25)
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, rope_parameters(config))
    q, k = torch.randn(5, 4, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    positions = torch.tensor([0, 3, 9, 100, 511])
    q_out, k_out = rotary(positions, q, k)
    assert torch.equal(q_out[..., 8:], q[..., 8:]) and torch.equal(k_out[..., 8:], k[..., 8:])
    assert torch.equal(q_out[0], q[0])  # position 0: no rotation
    assert not torch.allclose(q_out[1:, :, :8], q[1:, :, :8])


def test_gemma3_rope_per_layer_type():
    config = hf_config("gemma3_text", rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    for layer_type in ("sliding_attention", "full_attention"):
        ours = RotaryEmbedding(HEAD_DIM, MAX_POSITION, rope_parameters(config, layer_type)).cos_sin
        torch.testing.assert_close(ours, hf_table(config, layer_type=layer_type), rtol=1e-5, atol=1e-5)


def test_unsupported_rope_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported .*yarn, longrope"):
        RotaryEmbedding(HEAD_DIM, MAX_POSITION, {"rope_type": "dynamic", "rope_theta": 10000.0})
