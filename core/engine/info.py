"""What an engine is and what it has measured, as plain data: the public surface that tools (the CLI, scripts)
read instead of the engine's parts (runner, block manager, scheduler), which are free to change."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.distributed import tp_size
from nanovllm.models.costs import WeightCosts, weight_costs
from nanovllm.models.geometry import head_dim_of, kv_block_bytes, kv_heads_per_rank
from nanovllm.pooling import PoolingSpec


@dataclass(frozen=True)
class CostModel:
    """One rank's share of the work (its weight shard, its KV and attention heads), for a roofline."""

    kv_bytes_per_token: int  # K and V of one token over all layers, at the cache's element size (1 byte for FP8)
    attention_flops_per_pair: int  # QK^T and PV FLOPs of one (query, key) pair over all layers
    weights: WeightCosts  # the weights' bytes and FLOPs (models/costs.py: dense, or experts a batch selects)

    @property
    def weight_bytes_per_step(self) -> int:
        """Every weight (what a step of a dense model reads; the embedding table only gathers rows)."""
        return self.weights.all_bytes

    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token, logits included (active parameters only, for MoE)."""
        return self.weights.flops_per_token()

    def decode_weight_bytes(self, batch: int) -> float:
        """Weight bytes a decode step of `batch` sequences reads."""
        return self.weights.decode_step_bytes(batch)


@dataclass(frozen=True)
class EngineInfo:
    model: str
    vocab_size: int
    device: str  # "cpu" | "cuda" | "cuda:N"
    dtype: str  # "float32" | "float16" | "bfloat16"
    kv_cache_dtype: str  # the cache's element type: dtype's, or "float8_e4m3fn" | "float8_e5m2"
    tensor_parallel_size: int
    attention_backend: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int  # tokens per KV block
    num_kv_blocks: int
    kv_block_bytes: int  # one block, K and V over its layer slots (kv_groups.py), this rank's heads
    max_batch_size: int  # most sequences in a decode step
    decode_batch_sizes: tuple[int, ...]  # the batch sizes a decode step is padded to (its CUDA graphs' sizes)
    cuda_graphs: bool  # whether decode steps replay CUDA graphs
    prefix_caching: bool
    quantization: str | None  # the FP8 weight scheme (layers/fp8.py), None: weights in `dtype`
    costs: CostModel
    # Seconds of each phase of `LLM()` (model and tokenizer resolution, weights, the worst step measured before
    # the cache is sized, CUDA graph capture) and their total.
    startup_s: dict[str, float]
    max_loras: int = 0  # LoRA adapters resident on the device at once (0: no LoRA)
    max_lora_rank: int = 0
    pooling: PoolingSpec | None = None  # a pooling model's task, pooling and outputs; None for a generator


def model_costs(hf_config, model: torch.nn.Module, kv_cache_dtype: torch.dtype) -> CostModel:
    """The cost model of this process's rank of `model` (a whole model when there is no tensor parallelism)
    with a KV cache of `kv_cache_dtype` elements."""
    kv = kv_block_bytes(hf_config, 1, kv_cache_dtype.itemsize, kv_heads_per_rank(hf_config),  # a one-token block
                        hf_config.num_hidden_layers)
    attention = 4 * hf_config.num_hidden_layers * hf_config.num_attention_heads // tp_size() * head_dim_of(hf_config)
    return CostModel(kv, attention, weight_costs(model))
