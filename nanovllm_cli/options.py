"""Options shared by the commands (engine arguments named as in vLLM), exit codes and clean failures.

A command declares its options with these aliases and passes them to `engine_args(...)`, which keeps only the
ones given, so the engine's own defaults apply to the rest.
"""
from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from nanovllm import LLM

ENGINE = "Engine"
SAMPLING = "Sampling defaults (a row's own fields win)"


class ExitCode(IntEnum):
    OK = 0  # every row succeeded
    ROWS_FAILED = 1  # the job finished, some rows got error records
    USAGE = 2  # bad option or argument, unreadable input, model or OUTPUT unusable: nothing was run
    INTERNAL = 3  # the engine or the CLI failed mid-job; what was written stays, rerun with --resume
    INTERRUPTED = 130  # Ctrl-C or SIGTERM; what was written stays, rerun with --resume


Model = Annotated[str | None, typer.Option(
    "--model", "-m", help="HF checkpoint dir, .gguf file or preset (qwen3-0.6b, tiny-qwen3, ...). "
    "Default: the embedded SmolLM2-135M-Instruct.", rich_help_panel=ENGINE)]
Dtype = Annotated[str | None, typer.Option(
    help="auto | float32 | float16 | bfloat16 (auto: bf16 on GPU, fp32 on CPU).", rich_help_panel=ENGINE)]
MaxModelLen = Annotated[int | None, typer.Option(
    help="Longest prompt + output, in tokens (default: the model's limit).", rich_help_panel=ENGINE)]
MaxNumSeqs = Annotated[int | None, typer.Option(
    help="Most sequences in a step; also the most rows in the engine at once.", rich_help_panel=ENGINE)]
MaxNumBatchedTokens = Annotated[int | None, typer.Option(help="Token budget per step.", rich_help_panel=ENGINE)]
GpuMemoryUtilization = Annotated[float | None, typer.Option(
    help="Share of GPU memory the engine may use (weights + KV cache).", rich_help_panel=ENGINE)]
TensorParallelSize = Annotated[int | None, typer.Option(
    "--tensor-parallel-size", "-tp", help="GPUs to shard the model over.", rich_help_panel=ENGINE)]
EnforceEager = Annotated[bool, typer.Option("--enforce-eager", help="No CUDA graphs.", rich_help_panel=ENGINE)]
NoFusedOps = Annotated[bool, typer.Option(
    "--no-fused-ops", help="RMSNorm, rotary, SiLU as torch ops and every projection on cuBLAS, not Triton kernels (CUDA).",
    rich_help_panel=ENGINE)]
LoadFormat = Annotated[str | None, typer.Option(
    help="auto | dummy (random weights, for testing).", rich_help_panel=ENGINE)]
BlockSize = Annotated[int | None, typer.Option(help="KV-cache block size in tokens (default 16).",
                                               rich_help_panel=ENGINE)]
NoPrefixCaching = Annotated[bool, typer.Option(
    "--no-prefix-caching", help="Disable the prefix cache.", rich_help_panel=ENGINE)]
Async = Annotated[bool, typer.Option(
    "--async", help="Asynchronous scheduling: the host prepares step n+1 while the GPU runs step n.",
    rich_help_panel=ENGINE)]
NumKvBlocks = Annotated[int | None, typer.Option(
    help="Exact number of KV blocks (instead of sizing the cache from memory).", rich_help_panel=ENGINE)]
KvCacheGib = Annotated[float | None, typer.Option(
    help="KV-cache budget on the CPU, in GiB (default 1).", rich_help_panel=ENGINE)]
Device = Annotated[str | None, typer.Option(help="cpu | cuda (default: cuda when available).",
                                            rich_help_panel=ENGINE)]
AttentionBackend = Annotated[str | None, typer.Option(
    help="torch | triton | flash-attn (default: the best available).", rich_help_panel=ENGINE)]

Seed = Annotated[int, typer.Option(
    help="Engine seed. A row without its own seed samples with a seed derived from this and its id, so its "
    "output does not depend on order, batching or resume.", rich_help_panel=SAMPLING)]
MaxTokens = Annotated[int, typer.Option(help="Most output tokens per row.", rich_help_panel=SAMPLING)]
Temperature = Annotated[float, typer.Option(help="0 = greedy.", rich_help_panel=SAMPLING)]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].", rich_help_panel=SAMPLING)]
TopK = Annotated[int, typer.Option(help="Keep the k likeliest tokens; -1 = all.", rich_help_panel=SAMPLING)]
MinP = Annotated[float, typer.Option(help="Drop tokens below min_p x the top probability.",
                                     rich_help_panel=SAMPLING)]
Stop = Annotated[list[str] | None, typer.Option(
    help="Stop string (repeat the option for several).", rich_help_panel=SAMPLING)]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past EOS.",
                                         rich_help_panel=SAMPLING)]


def engine_args(*, dtype: str | None = None, max_model_len: int | None = None, max_num_seqs: int | None = None,
                max_num_batched_tokens: int | None = None, gpu_memory_utilization: float | None = None,
                tensor_parallel_size: int | None = None, enforce_eager: bool = False, no_fused_ops: bool = False,
                load_format: str | None = None, block_size: int | None = None, no_prefix_caching: bool = False,
                async_scheduling: bool = False, num_kv_blocks: int | None = None,
                kv_cache_gib: float | None = None, device: str | None = None,
                attention_backend: str | None = None, seed: int | None = None) -> dict:
    """The keyword arguments of `LLM(model, **engine_args(...))`: only the options given on the command line."""
    args = {"dtype": dtype, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size, "load_format": load_format, "block_size": block_size,
            "num_kv_blocks": num_kv_blocks, "device": device, "attention_backend": attention_backend,
            "seed": seed,
            "cpu_kv_cache_bytes": None if kv_cache_gib is None else int(kv_cache_gib * (1 << 30)),
            "enforce_eager": enforce_eager or None,
            "fused_ops": False if no_fused_ops else None,
            "enable_prefix_caching": False if no_prefix_caching else None,
            "async_scheduling": async_scheduling or None}
    return {k: v for k, v in args.items() if v is not None}


def fail(message: str) -> typer.Exit:
    """Print a one-line error on stderr and return the usage-error Exit to raise (no traceback)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(ExitCode.USAGE)


def load_llm(model: str | None, args: dict) -> LLM:
    """LLM(model, **args), or a clean usage error when the model cannot be loaded with these arguments."""
    from nanovllm import LLM

    try:
        return LLM(model, **args)
    except (ValueError, OSError, ImportError, RuntimeError, KeyError) as exc:
        raise fail(f"cannot load the model: {exc}") from None
