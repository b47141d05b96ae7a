"""MoE families on a CUDA device (`pytest -m gpu`): bf16 greedy output of tiny random Qwen3-MoE, Qwen2-MoE and
Mixtral checkpoints against HF transformers by the near-tie rule of test_gpu_engine.py, and Qwen3-30B-A3B's
shape with dummy weights through CUDA graphs."""
import gc
import json

import pytest
import torch
from conftest import save_random_hf_model
from test_gpu_engine import check_against_hf, random_prompts

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"])
def test_bf16_greedy_vs_hf_on_random_moe_weights(preset, tmp_path):
    directory = save_random_hf_model(preset, tmp_path / preset, dtype=torch.bfloat16)
    check_against_hf(preset, directory, random_prompts(json.loads((directory / "config.json").read_text())["vocab_size"]))


def test_qwen3_30b_a3b_shape_runs_through_cuda_graphs():
    """61 GB of dummy bf16 weights; decode steps replay graphs with the fused MoE inside (no host sync)."""
    llm = LLM("qwen3-30b-a3b", load_format="dummy", max_model_len=2048, max_num_seqs=64)
    try:
        assert llm._runner.graphs is not None
        prompts = [[(7 * i + j) % 1000 for j in range(20 + 13 * i)] for i in range(40)]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert all(len(o.token_ids) == 24 for o in outputs)
        assert llm.get_stats()["decode_steps"] > 0
    finally:
        llm.exit()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
