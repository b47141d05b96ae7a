"""What the engine would do with a set of prompts, from the model's config and tokenizer alone (no weights, no
device): the KV cache it would size and the prefix-cache hits its block manager would find."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.attention.kv_quant import check_fp8_kv_supported
from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import NO_HASH, BlockManager, compute_block_hash
from nanovllm.engine.sequence import Sequence
from nanovllm.kv_groups import plan_kv_groups
from nanovllm.loaders import resolve_model
from nanovllm.models.geometry import kv_block_bytes, kv_heads_per_rank, layer_windows
from nanovllm.models.registry import model_class_for
from nanovllm.pooling import PoolingSpec, resolve_task
from nanovllm.sampling_params import SamplingParams
from nanovllm.tokenization import PromptTokenizer


@dataclass
class KVCachePlan:
    model: str
    prompts: PromptTokenizer  # tokenizes and renders chat templates as the engine does
    max_model_len: int
    block_size: int
    kv_cache_dtype: str  # the cache's element type ("bfloat16", "float8_e4m3fn", ...)
    dtype_bytes: int  # of one cache element
    bytes_per_block: int  # K and V of one block over its layer slots, every KV head (no tensor parallelism)
    num_blocks: int
    num_blocks_source: str  # how num_blocks was found
    kv_windows: tuple[int | None, ...]  # per KV group (kv_groups.py): its sliding window, None for global

    @property
    def cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def plan_kv_cache(model: str | None = None, num_blocks: int | None = None, **engine_args) -> KVCachePlan:
    """The KV cache `LLM(model, **engine_args)` would have: `num_blocks` blocks when given, else on the CPU the
    CPU budget's, on a GPU memory x gpu_memory_utilization - weights (activations not counted: an upper bound).
    Raises ValueError / OSError for bad arguments or a model that cannot be resolved."""
    config = EngineConfig.from_kwargs(**{"load_format": "dummy", **engine_args})
    resolved = resolve_model(model, config.load_format, config.revision, config.tokenizer)
    hf = resolved.hf_config
    limit = hf.max_position_embeddings
    device = config.resolve_device()
    check_fp8_kv_supported(config.kv_cache_dtype, device)
    pooling = resolve_task(hf, resolved.directory, config.runner, config.task)
    kv_dtype = config.resolve_kv_cache_dtype(device)
    groups = plan_kv_groups(layer_windows(hf))
    bytes_per_block = kv_block_bytes(hf, config.block_size, kv_dtype.itemsize, kv_heads_per_rank(hf), groups.width)
    if num_blocks is not None:
        source = "given (num_blocks)"
    elif device.type == "cpu":
        num_blocks, source = config.cpu_kv_cache_bytes // bytes_per_block, "the CPU KV budget (cpu_kv_cache_bytes)"
    else:
        with torch.device("meta"):
            params = sum(p.numel() for p in model_class_for(hf, pooling.model_kind if pooling else "generate")(hf)
                         .parameters())
        weights = params * config.resolve_dtype(device).itemsize
        total = torch.cuda.get_device_properties(device).total_memory
        num_blocks = max(int(total * config.gpu_memory_utilization - weights) // bytes_per_block, 1)
        source = "GPU memory x gpu_memory_utilization - weights (activations not counted: an upper bound)"
    return KVCachePlan(resolved.name, PromptTokenizer.for_model(resolved, pooling),
                       config.max_model_len or limit, config.block_size, str(kv_dtype).removeprefix("torch."),
                       kv_dtype.itemsize, bytes_per_block, num_blocks, source, groups.windows)


def check_engine_args(**engine_args) -> None:
    """Raise ValueError naming an engine argument `LLM()` would refuse (an unknown name, a bad value), without
    resolving a model."""
    EngineConfig.from_kwargs(**engine_args)


def pooling_spec(model: str | None = None, **engine_args) -> PoolingSpec | None:
    """How `LLM(model, **engine_args)` would pool (its task, outputs, input rules), or None where it would
    generate; from the model's config and sentence-transformers files alone. Raises ValueError / OSError for bad
    arguments, a model that cannot be resolved, or a task it cannot run."""
    config = EngineConfig.from_kwargs(**{"load_format": "dummy", **engine_args})
    resolved = resolve_model(model, config.load_format, config.revision, config.tokenizer)
    return resolve_task(resolved.hf_config, resolved.directory, config.runner, config.task)


@dataclass(frozen=True)
class ModelSource:
    """What `LLM(model, **engine_args)` would run, known before anything loads."""

    name: str
    preset: bool  # a model shape (random weights only, no tokenizer of its own): load_format="dummy" runs it
    has_tokenizer: bool  # its own, or the one `tokenizer` names: without one, only token ids go in and out
    pooling: PoolingSpec | None  # as `pooling_spec` says


def model_source(model: str | None = None, **engine_args) -> ModelSource:
    """What `model` is, from its config alone (no weights, no tokenizer load). Raises as `pooling_spec`."""
    config = EngineConfig.from_kwargs(**{"load_format": "dummy", **engine_args})
    resolved = resolve_model(model, config.load_format, config.revision, config.tokenizer)
    return ModelSource(resolved.name, resolved.preset, resolved.tokenizer_dir is not None,
                       resolve_task(resolved.hf_config, resolved.directory, config.runner, config.task))


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks, by the engine's own hash function."""
    hashes = []
    prefix = NO_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prefix = compute_block_hash(prefix, token_ids[start:start + block_size])
        hashes.append(prefix)
    return hashes


class PrefixCacheReplay:
    """Prompts through the engine's block manager one at a time: admitted with their prefix hits, fully
    computed, hashed, freed. `report()` gives the hits and evictions a cache of `num_blocks` would see."""

    def __init__(self, num_blocks: int, block_size: int, kv_windows: tuple[int | None, ...] = (None,)):
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True, windows=kv_windows)
        self.rows_not_fitting = 0

    def add(self, token_ids: list[int]) -> None:
        bm = self.manager
        seq = Sequence(0, "replay", token_ids, SamplingParams(max_tokens=1), 0)
        if not bm.admit(seq, seq.num_tokens):
            self.rows_not_fitting += 1  # the prompt alone is larger than the whole cache
            return
        num_new = seq.num_uncomputed_tokens
        seq.start_step(num_new, samples=False)
        seq.commit_step(num_new, None)
        bm.commit_computed_blocks(seq)
        bm.free(seq)

    def report(self) -> dict:
        stats = self.manager.stats
        return {"hit_tokens": stats.hit_tokens, "hit_rate": stats.hit_rate, "evictions": stats.evictions,
                "rows_not_fitting": self.rows_not_fitting}
