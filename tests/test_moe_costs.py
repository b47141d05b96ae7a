"""The MoE cost model behind bench's roofline (core/models/costs.py): distinct experts, the experts a step of the
ideal schedule reads, weight bytes and FLOPs of a built model, counted by hand."""
import json

import pytest
import torch
from conftest import PRESETS
from transformers import AutoConfig

from nanovllm import CostModel
from nanovllm.engine.info import model_costs
from nanovllm.loaders import load_dummy_weights
from nanovllm.models.costs import ExpertLayer, WeightCosts, expected_distinct_experts, weight_costs
from nanovllm.models.registry import model_class_for
from nanovllm_cli.roofline import DeviceCeilings, roofline_seconds


def build(preset: str, device: str = "cpu"):
    config = AutoConfig.for_model(**json.loads((PRESETS / f"{preset}.json").read_text()))
    with torch.device(device):
        return config, model_class_for(config)(config)


def test_expected_distinct_experts():
    assert expected_distinct_experts(4, 2, 1) == 2  # one token: exactly its top-k
    assert expected_distinct_experts(4, 2, 2) == pytest.approx(3)  # 4 (1 - (1/2)^2)
    assert expected_distinct_experts(128, 8, 10_000) == pytest.approx(128)


def test_weight_costs_by_hand():
    """tiny-qwen3-moe: hidden 64, 3 layers (0 and 2 sparse with 8 experts of 32, top-2; 1 dense of 96), 4 heads
    and 2 KV heads of 16, vocab 512, untied; fp32."""
    config, model = build("tiny-qwen3-moe")
    h, v = 64, 512
    attention = h * (4 + 2 + 2) * 16 + 4 * 16 * h + 2 * 16  # q/k/v and o projections, q/k norms
    dense_mlp, router, expert = 3 * h * 96, 8 * h, 3 * h * 32
    norms = 2 * h
    shared_matmul = 3 * (attention - 32) + dense_mlp + 2 * router + v * h  # LM head; input embedding excluded
    shared_params = 3 * (attention + norms) + dense_mlp + 2 * router + v * h + h
    costs = weight_costs(model)
    assert costs.shared_matmul_params == shared_matmul
    assert costs.shared_bytes == 4 * shared_params
    assert [(layer.num_experts, layer.top_k, layer.expert_params) for layer in costs.expert_layers] == [(8, 2, expert)] * 2
    assert costs.flops_per_token() == 2 * (shared_matmul + 2 * 2 * expert)
    assert costs.decode_step_bytes(1) == 4 * (shared_params + 2 * 2 * expert)
    assert costs.all_bytes == 4 * (shared_params + 2 * 8 * expert)


def test_roofline_reads_only_the_selected_experts():
    """Rows (prompt 3, 2 outputs) then (prompt 1, 3 outputs) at batch 1, 1000 shared weight bytes and one MoE
    layer of 2 experts of 10 bytes, top-1; a matmul rate so high that every step is bound by its bytes. The
    schedule: A's prefill (3 tokens select 2 (1 - 1/2^3) = 1.75 experts), A's decode (context 4), B's prefill
    (1 token, 1 expert), B's decodes (contexts 2, 3); a token's KV is 100 bytes."""
    costs = CostModel(kv_bytes_per_token=100, attention_flops_per_pair=2,
                      weights=WeightCosts(shared_bytes=1000, shared_matmul_params=5,
                                          expert_layers=(ExpertLayer(2, 1, expert_bytes=10, expert_params=0),)))
    ceilings = DeviceCeilings("test", copy_bytes_per_s=1e4, matmul_flops_per_s=1e9)
    step_bytes = [1000 + 17.5, 1000 + 10 + 400, 1000 + 10, 1000 + 10 + 200, 1000 + 10 + 300]
    assert roofline_seconds(costs, [3, 1], [2, 3], 1, ceilings) == pytest.approx(sum(step_bytes) / 1e4, rel=1e-12)


def test_model_costs_of_a_dense_model_keep_every_step_reading_all_weights():
    config, model = build("tiny-qwen3")
    load_dummy_weights(model)
    costs = model_costs(config, model, torch.float32)
    assert costs.decode_weight_bytes(1) == costs.decode_weight_bytes(256) == costs.weight_bytes_per_step


def test_qwen3_30b_a3b_preset_has_its_published_sizes():
    """30.5B parameters in all; 3.3B active per token (input embedding included, as Qwen counts them), to their rounding."""
    config, model = build("qwen3-30b-a3b", "meta")
    costs = weight_costs(model)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(30.5, abs=0.05)
    active = costs.flops_per_token() / 2 + config.vocab_size * config.hidden_size
    assert active / 1e9 == pytest.approx(3.3, rel=0.03)  # published to one decimal: 3.35
