from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from nanovllm.attention.kv_quant import KV_CACHE_DTYPES, resolve_kv_cache_dtype
from nanovllm.pooling_params import POOLING_TASKS
from nanovllm.sampling_params import is_int64

_DTYPES = {"auto", "float32", "float16", "bfloat16"}
_LOAD_FORMATS = {"auto", "dummy"}
_ATTENTION_BACKENDS = {None, "torch", "triton", "flash-attn"}
_QUANTIZATIONS = {None, "fp8"}
MAX_LORA_RANK = 256
RUNNERS = ("auto", "generate", "pooling")


@dataclass
class EngineConfig:
    """Engine arguments, named as in vLLM. `LLM(**kwargs)` builds one through `from_kwargs`."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" (= "fp8_e4m3") or "fp8_e5m2" (docs/FP8.md)
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: chosen from the KV cache on a GPU (runner/memory_budget.py), 256 on the CPU
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # The CPU has no memory profile to size the cache from: the budget is this explicit size.
    cpu_kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    revision: str | None = None  # of a Hugging Face Hub model id: a branch, tag or commit (default: main)
    tokenizer: str | None = None  # a tokenizer folder or Hub id instead of the model's own (vLLM's `tokenizer`)
    async_scheduling: bool = False
    attention_backend: str | None = None
    # "fp8": FP8 weights for the decoder's linear layers (layers/fp8.py); an FP8 checkpoint needs no argument.
    quantization: str | None = None
    fused_ops: bool = True  # on CUDA: RMSNorm, q/k norm + rotary, SiLU-and-mul, decode-sized GEMMs as Triton kernels
    device: str | None = None
    seed: int = 0
    # Multi-LoRA (nanovllm.lora): requests may name adapters; `max_loras` of them are resident at once on the
    # device, each of rank up to `max_lora_rank`.
    enable_lora: bool = False
    max_loras: int = 8
    max_lora_rank: int = 16
    # Generate or pool (pooling/task.py): "auto" decides from the checkpoint; `task` (embed, classify, score,
    # reward) names a pooling model's default task, and makes a causal LM an embedder.
    runner: str = "auto"
    task: str | None = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"engine argument {name}={getattr(self, name)!r}: {why}")

        def positive_int(name: str, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            check(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, "must be a positive integer")

        check(self.dtype in _DTYPES, "dtype", f"must be one of {sorted(_DTYPES)}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {list(KV_CACHE_DTYPES)}")
        positive_int("max_model_len", optional=True)
        positive_int("max_num_seqs", optional=True)
        positive_int("max_num_batched_tokens")
        positive_int("block_size")
        check(self.block_size & (self.block_size - 1) == 0, "block_size", "must be a power of two")
        positive_int("num_kv_blocks", optional=True)
        positive_int("cpu_kv_cache_bytes")
        positive_int("tensor_parallel_size")
        check(isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
              "gpu_memory_utilization", "must be in (0, 1]")
        check(self.load_format in _LOAD_FORMATS, "load_format", f"must be one of {sorted(_LOAD_FORMATS)}")
        check(self.attention_backend in _ATTENTION_BACKENDS, "attention_backend",
              f"must be one of {sorted(b for b in _ATTENTION_BACKENDS if b)}")
        check(self.quantization in _QUANTIZATIONS, "quantization",
              f"must be one of {sorted(q for q in _QUANTIZATIONS if q)} (or None)")
        check(self.device in (None, "cpu", "cuda"), "device", "must be 'cpu' or 'cuda'")
        check(is_int64(self.seed), "seed", "must be an integer in [-2**63, 2**63 - 1]")  # torch's generators: int64
        check(self.revision is None or (isinstance(self.revision, str) and self.revision != ""), "revision",
              "must be a non-empty branch, tag or commit name")
        check(isinstance(self.fused_ops, bool), "fused_ops", "must be True or False")
        check(isinstance(self.enable_lora, bool), "enable_lora", "must be True or False")
        positive_int("max_loras")
        positive_int("max_lora_rank")
        check(self.max_lora_rank <= MAX_LORA_RANK, "max_lora_rank", f"must be at most {MAX_LORA_RANK}")
        check(self.runner in RUNNERS, "runner", f"must be one of {', '.join(RUNNERS)}")
        check(self.task is None or self.task in POOLING_TASKS, "task", f"must be one of {', '.join(POOLING_TASKS)}")

    def resolve_device(self) -> torch.device:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("engine argument device='cuda' but no CUDA device is available")
        name = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(name)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        # fp32 on the CPU: it is the reference path, and CPU bf16 matmuls are slow.
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def resolve_kv_cache_dtype(self, device: torch.device) -> torch.dtype:
        """The KV cache's element type on `device` (the model's dtype for "auto")."""
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.resolve_dtype(device))
