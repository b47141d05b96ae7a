"""What an engine is and what it has measured, as plain data: the public surface that tools (the CLI, scripts)
read instead of the engine's parts (runner, block manager, scheduler), which are free to change."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanovllm.distributed import tp_size
from nanovllm.models.costs import WeightCosts, weight_costs
from nanovllm.models.llama import head_dim_of, kv_block_bytes, kv_heads_per_rank
from nanovllm.runner.cuda_graphs import batch_size_ladder

if TYPE_CHECKING:
    from nanovllm.engine.llm_engine import LLM


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


def model_costs(hf_config, model: torch.nn.Module, kv_cache_dtype: torch.dtype) -> CostModel:
    """The cost model of this process's rank of `model` (a whole model when there is no tensor parallelism)
    with a KV cache of `kv_cache_dtype` elements."""
    kv = kv_block_bytes(hf_config, 1, kv_cache_dtype.itemsize, kv_heads_per_rank(hf_config),  # a one-token block
                        hf_config.num_hidden_layers)
    attention = 4 * hf_config.num_hidden_layers * hf_config.num_attention_heads // tp_size() * head_dim_of(hf_config)
    return CostModel(kv, attention, weight_costs(model))


def engine_info(llm: LLM) -> EngineInfo:
    runner, config = llm._runner, llm.config
    return EngineInfo(
        model=llm.model_name, vocab_size=llm.hf_config.vocab_size, device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
        kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."), tensor_parallel_size=config.tensor_parallel_size,
        attention_backend=runner.attention_backend, max_model_len=llm.max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size, num_kv_blocks=runner.num_kv_blocks,
        kv_block_bytes=runner.kv_block_bytes,
        max_batch_size=runner.max_batch_size, decode_batch_sizes=tuple(batch_size_ladder(runner.max_batch_size)),
        cuda_graphs=runner.graphs is not None, prefix_caching=config.enable_prefix_caching,
        quantization=runner.fp8.name if runner.fp8 is not None else None,
        costs=model_costs(llm.hf_config, runner.model, runner.kv_cache_dtype))


def engine_report(llm: LLM) -> dict:
    """The step statistics since the start or `reset_stats`, the KV-cache metrics, and token counters that
    move every step (finished requests alone say nothing of progress inside long ones)."""
    stats = llm.stats
    # Every decode token yields one output token; a request's first output token comes from its prefill.
    tokens = {"prefill": stats.prefill_tokens, "generated": stats.decode_tokens + stats.requests}
    return {"steps": llm.get_stats(), "kv_cache": llm.get_metrics(), "tokens": tokens}
