"""Options shared by the commands (the engine's, declared once in `EngineOptions`), exit codes and clean
failures."""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, get_type_hints

import typer

if TYPE_CHECKING:
    from nanovllm import LLM, ModelSource, PromptTokenizer

ENGINE = "Engine"
SAMPLING = "Sampling defaults (a row's own fields win)"
POOLING = "Pooling defaults (a row's own fields win)"


class ExitCode(IntEnum):
    OK = 0  # every row succeeded
    ROWS_FAILED = 1  # the job finished, some rows got error records
    USAGE = 2  # bad option or argument, unreadable input, model or OUTPUT unusable: nothing was run
    INTERNAL = 3  # the engine or the CLI failed mid-job; what was written stays, rerun with --resume
    INTERRUPTED = 130  # Ctrl-C or SIGTERM; what was written stays, rerun with --resume


@dataclass(frozen=True)
class EngineOptions:
    """The engine's options, declared once (named as vLLM's engine arguments). A command takes them with
    `@with_engine_options(...)` and receives them as one `engine: EngineOptions` argument."""

    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="HF checkpoint dir, .gguf file or Hugging Face Hub id (Qwen/Qwen3-0.6B). Default: the "
        "embedded SmolLM2-135M-Instruct. A model shape with random weights and no tokenizer (qwen3-0.6b, tiny-qwen3, "
        "...: core/presets) needs --load-format dummy.", rich_help_panel=ENGINE)] = None
    revision: Annotated[str | None, typer.Option(
        help="Branch, tag or commit of a Hub model id (default: main).", rich_help_panel=ENGINE)] = None
    dtype: Annotated[str | None, typer.Option(
        help="auto | float32 | float16 | bfloat16 (auto: bf16 on GPU, fp32 on CPU).", rich_help_panel=ENGINE)] = None
    kv_cache_dtype: Annotated[str | None, typer.Option(
        help="auto | fp8 | fp8_e4m3 | fp8_e5m2: the KV cache's element type (auto: the model's dtype; fp8 = "
        "e4m3, half of bf16's bytes per block; GPU compute capability >= 8.9, or the CPU reference path).",
        rich_help_panel=ENGINE)] = None
    max_model_len: Annotated[int | None, typer.Option(
        help="Longest prompt + output, in tokens (default: the model's limit).", rich_help_panel=ENGINE)] = None
    max_num_seqs: Annotated[int | None, typer.Option(
        help="Most sequences in a step; also the most rows in the engine at once.", rich_help_panel=ENGINE)] = None
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        help="Token budget per step.", rich_help_panel=ENGINE)] = None
    gpu_memory_utilization: Annotated[float | None, typer.Option(
        help="Share of GPU memory the engine may use (weights + KV cache).", rich_help_panel=ENGINE)] = None
    tensor_parallel_size: Annotated[int | None, typer.Option(
        "--tensor-parallel-size", "-tp", help="GPUs to shard the model over.", rich_help_panel=ENGINE)] = None
    data_parallel_size: Annotated[int, typer.Option(
        "--data-parallel-size", "-dp", help="Engine replicas, each a process on its own GPUs (replica i: "
        "GPUs [i*TP, (i+1)*TP)); more replicas than GPU sets share them when their --gpu-memory-utilization adds "
        "up to at most 0.95 per GPU. Rows sharing a prefix go to the same replica.", rich_help_panel=ENGINE)] = 1
    enforce_eager: Annotated[bool, typer.Option(
        "--enforce-eager", help="No CUDA graphs.", rich_help_panel=ENGINE)] = False
    no_fused_ops: Annotated[bool, typer.Option(
        "--no-fused-ops", help="RMSNorm, rotary, SiLU as torch ops and every projection on cuBLAS, not Triton "
        "kernels (CUDA).", rich_help_panel=ENGINE)] = False
    load_format: Annotated[str | None, typer.Option(
        help="auto | dummy (random weights, for testing).", rich_help_panel=ENGINE)] = None
    quantization: Annotated[str | None, typer.Option(
        help="fp8: FP8 weights for the decoder's linear layers, quantized at load (the LM head and MoE experts "
        "stay bf16; GPUs of compute capability >= 8.9). FP8 checkpoints need no flag.", rich_help_panel=ENGINE)] = None
    block_size: Annotated[int | None, typer.Option(
        help="KV-cache block size in tokens (default 16).", rich_help_panel=ENGINE)] = None
    no_prefix_caching: Annotated[bool, typer.Option(
        "--no-enable-prefix-caching", "--no-prefix-caching", help="Disable the prefix cache.",
        rich_help_panel=ENGINE)] = False
    async_scheduling: Annotated[bool, typer.Option(
        "--async-scheduling", "--async", help="Asynchronous scheduling: the host prepares step n+1 while the GPU "
        "runs step n.", rich_help_panel=ENGINE)] = False
    num_kv_blocks: Annotated[int | None, typer.Option(
        "--num-gpu-blocks-override", "--num-kv-blocks", help="Exact number of KV blocks (instead of sizing the "
        "cache from memory).", rich_help_panel=ENGINE)] = None
    kv_cache_gib: Annotated[float | None, typer.Option(
        help="KV-cache budget on the CPU, in GiB (default 1).", rich_help_panel=ENGINE)] = None
    device: Annotated[str | None, typer.Option(
        help="cpu | cuda (default: cuda when available).", rich_help_panel=ENGINE)] = None
    attention_backend: Annotated[str | None, typer.Option(
        help="torch | triton | flash-attn (default: the best available).", rich_help_panel=ENGINE)] = None
    lora_modules: Annotated[list[str] | None, typer.Option(
        help="A LoRA adapter the rows may name, as NAME=PATH (a PEFT adapter folder or Hub id); repeat the option "
        "for several. A row names its adapter in its `lora` field, an OpenAI line in body.model.",
        rich_help_panel=ENGINE)] = None
    enable_lora: Annotated[bool, typer.Option(
        "--enable-lora", help="Engine support for LoRA adapters (implied by --lora-modules).",
        rich_help_panel=ENGINE)] = False
    max_loras: Annotated[int | None, typer.Option(
        help="LoRA adapters resident on the device at once (default 8); rows of others wait for a slot.",
        rich_help_panel=ENGINE)] = None
    max_lora_rank: Annotated[int | None, typer.Option(
        help="Highest LoRA rank an adapter may have (default 16; at most 256).", rich_help_panel=ENGINE)] = None
    task: Annotated[str | None, typer.Option(
        help="embed | classify | score | reward: the pooling task (embeddings, label probabilities, pair scores, "
        "rewards) instead of generating; a causal LM embeds with its decoder. Default: the checkpoint's own (an "
        "embedding or classification checkpoint pools, a causal LM generates).", rich_help_panel=ENGINE)] = None
    chat_template: Annotated[str | None, typer.Option(
        "--chat-template", metavar="FILE", help="A Jinja chat template for 'messages' rows instead of the model's "
        "(a row cannot bring one).", rich_help_panel=ENGINE)] = None
    tokenizer: Annotated[str | None, typer.Option(
        "--tokenizer", metavar="PATH", help="A tokenizer folder or Hub id to use instead of the model's own (e.g. "
        "a shape's: --model qwen3-0.6b --load-format dummy --tokenizer Qwen/Qwen3-0.6B).", rich_help_panel=ENGINE)] = None
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", metavar="NAME", help="The model's name in the records and OpenAI bodies (default: "
        "its folder or Hub id); an OpenAI line's body.model may name it.", rich_help_panel=ENGINE)] = None

    def chat_template_text(self) -> str | None:
        """The text of the --chat-template file, or None; ValueError naming the file when it cannot be used."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        if not path.is_file():
            raise ValueError(f"--chat-template {path}: " + ("not a regular file" if path.exists() else "no such file"))
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--chat-template {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--chat-template {path}: not UTF-8 text") from None
        if not text.strip():
            raise ValueError(f"--chat-template {path}: the file is empty")
        return text

    def args(self, seed: int | None = None) -> dict:
        """The keyword arguments of `LLM(model, **args)` (of each replica's, with data parallelism): only the
        options given, so the engine's own defaults apply to the rest. Raises ValueError naming the option for a
        value only the CLI can judge."""
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, not {self.data_parallel_size}")
        if self.kv_cache_gib is not None and not (math.isfinite(self.kv_cache_gib) and self.kv_cache_gib > 0):
            raise ValueError(f"--kv-cache-gib must be a positive number of GiB, not {self.kv_cache_gib}")
        if seed is not None and not -(1 << 63) <= seed < 1 << 63:
            raise ValueError(f"--seed must be an integer in [-2**63, 2**63 - 1], not {seed}")
        self.chat_template_text()  # readable before anything loads
        args = {"dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype, "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "tensor_parallel_size": self.tensor_parallel_size, "load_format": self.load_format,
                "quantization": self.quantization,
                "revision": self.revision, "tokenizer": self.tokenizer,
                "block_size": self.block_size, "num_kv_blocks": self.num_kv_blocks, "device": self.device,
                "attention_backend": self.attention_backend, "seed": seed, "task": self.task,
                "cpu_kv_cache_bytes": None if self.kv_cache_gib is None else max(int(self.kv_cache_gib * (1 << 30)), 1),
                "enforce_eager": self.enforce_eager or None,
                "fused_ops": False if self.no_fused_ops else None,
                "enable_prefix_caching": False if self.no_prefix_caching else None,
                "async_scheduling": self.async_scheduling or None,
                "enable_lora": self.enable_lora or bool(self.lora_modules) or None,
                "max_loras": self.max_loras, "max_lora_rank": self.max_lora_rank}
        return {k: v for k, v in args.items() if v is not None}


def with_engine_options(*names: str, exclude: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Add the engine options `names` (every one but `exclude` when none are named) to a typer command's
    parameters; the command receives them as `engine: EngineOptions` (options not named keep their defaults)."""
    hints = get_type_hints(EngineOptions, include_extras=True)
    defaults = {f.name: f.default for f in fields(EngineOptions)}
    unknown = (set(names) | set(exclude)) - set(defaults)
    if unknown:
        raise ValueError(f"not engine options: {sorted(unknown)}")
    chosen = names or tuple(n for n in defaults if n not in exclude)

    def decorate(command: Callable) -> Callable:
        own = inspect.signature(command, eval_str=True)
        params = [p for p in own.parameters.values() if p.name != "engine"]
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=defaults[n], annotation=hints[n])
                   for n in chosen]

        def command_with_engine_options(**kwargs):
            engine = EngineOptions(**{n: kwargs.pop(n) for n in chosen})
            return command(engine=engine, **kwargs)

        command_with_engine_options.__name__ = command.__name__
        command_with_engine_options.__doc__ = command.__doc__
        command_with_engine_options.__signature__ = own.replace(parameters=params)
        return command_with_engine_options

    return decorate


Seed = Annotated[int, typer.Option(
    help="Engine seed. A row without its own seed samples with a seed derived from this and its id, so its "
    "output does not depend on order, batching or resume.", rich_help_panel=SAMPLING)]
MaxTokens = Annotated[int, typer.Option(help="Most output tokens per row.", rich_help_panel=SAMPLING)]
Temperature = Annotated[float | None, typer.Option(
    help="0 = greedy. Default: 0 for plain rows; an OpenAI line without its own takes OpenAI's default, 1, unless "
    "this option is given.", rich_help_panel=SAMPLING)]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].", rich_help_panel=SAMPLING)]
TopK = Annotated[int, typer.Option(help="Keep the k likeliest tokens; -1 = all.", rich_help_panel=SAMPLING)]
MinP = Annotated[float, typer.Option(help="Drop tokens below min_p x the top probability.",
                                     rich_help_panel=SAMPLING)]
Stop = Annotated[list[str] | None, typer.Option(
    help="Stop string (repeat the option for several).", rich_help_panel=SAMPLING)]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Keep generating past EOS.",
                                         rich_help_panel=SAMPLING)]


def fail(message: str) -> typer.Exit:
    """Print a one-line error on stderr and return the usage-error Exit to raise (no traceback)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(ExitCode.USAGE)


def model_source(engine: EngineOptions) -> ModelSource | None:
    """What --model names, from its config before anything loads; None when it cannot be resolved: loading it
    says why, once the whole-file checks have had their say (with --ray, on the node that loads it: the driver may
    lack the model). A model shape is a usage error unless asked for with --load-format dummy: it has random
    weights, which must never pass for a model's answers."""
    from nanovllm import check_engine_args
    from nanovllm import model_source as describe

    try:  # the options themselves are checked here, strictly: only the model's resolution may fail quietly
        args = engine.args()
        check_engine_args(**args)
    except ValueError as exc:
        raise fail(str(exc)) from None
    try:
        source = describe(engine.model, **args)
    except (ValueError, OSError, ImportError, KeyError):
        return None
    if source.preset and engine.load_format != "dummy":
        raise fail(f"--model {engine.model} is a model shape (random weights, no tokenizer), not a model: add "
                   "--load-format dummy to run the shape (benchmarks, tests), or name a checkpoint folder, a .gguf "
                   "file or a Hub id (e.g. Qwen/Qwen3-0.6B)")
    return source


def load_llm(engine: EngineOptions, seed: int | None = None) -> LLM:
    """The engine these options describe, or a clean usage error when it cannot be loaded with them."""
    from nanovllm import LLM

    try:
        args = engine.args(seed)
    except ValueError as exc:
        raise fail(str(exc)) from None
    try:
        llm = LLM(engine.model, **args)
    except (ValueError, OSError, ImportError, RuntimeError, KeyError) as exc:
        raise fail(f"cannot load the model: {exc}") from None
    try:
        use_chat_template(engine, llm.prompts)
    except typer.Exit:
        llm.exit()
        raise
    return llm


def use_chat_template(engine: EngineOptions, prompts: PromptTokenizer) -> None:
    """Give `prompts` the --chat-template, if one was given (a usage error when it does not fit the model)."""
    try:
        text = engine.chat_template_text()
    except ValueError as exc:
        raise fail(str(exc)) from None
    if text is None:
        return
    try:
        prompts.use_chat_template(text)
    except ValueError as exc:
        raise fail(f"--chat-template {engine.chat_template}: {exc}") from None
