"""`nanovllm bench --lora N`'s adapters: N random LoRA adapters of one rank for the engine's model
(`save_random_lora_adapter`, on every attention and dense-MLP projection), spread over the workload's rows (row
i runs adapter i mod N). The engine is made with enable_lora and max_lora_rank >= the rank; with fewer than N
slots (--max-loras) rows wait for them, as in a real job. bench.py runs the rows with them, then on the base
model (`lora_pair`)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from nanovllm_cli.bench_workload import Workload, run_workload, warmup_workload
from nanovllm_cli.options import EngineOptions


def lora_engine(engine: EngineOptions, rank: int) -> EngineOptions:
    """The engine options with LoRA on and room for adapters of `rank`."""
    return dataclasses.replace(engine, enable_lora=True, max_lora_rank=max(engine.max_lora_rank or 0, rank))


def random_adapters(llm, count: int, rank: int, seed: int, root: Path) -> list:
    """`count` random adapters of `rank` for the engine's model, written under `root`, as LoRARequests."""
    from nanovllm import LoRARequest, save_random_lora_adapter

    return [LoRARequest(f"random-{i}", i + 1, save_random_lora_adapter(llm.hf_config, root / f"adapter-{i}", rank,
                                                                       seed + i))
            for i in range(count)]


def spread(adapters: list, num_rows: int) -> list:
    """Row i's adapter: adapter i mod N."""
    return [adapters[i % len(adapters)] for i in range(num_rows)]


def lora_pair(llm, workload: Workload, sampling: dict, adapters: list, label: str, show_progress: bool,
              warmup_seed: int | None) -> dict:
    """The workload with the LoRA adapters spread over its rows (bench_lora.py), then on the base model, in the
    same engine; their output throughputs' ratio. The warm-up (`warmup_seed`) runs with the adapters: the LoRA
    kernels' compiles, their graphs' first launches and the adapters' first loads stay out of the measured runs."""
    if warmup_seed is not None:
        warm = warmup_workload(llm, warmup_seed)
        run_workload(llm, warm, f"{label} lora warm-up", False, sampling, spread(adapters, len(warm.prompts)))
    lora, outputs = run_workload(llm, workload, f"{label} lora", show_progress, sampling,
                                 spread(adapters, len(workload.prompts)))
    lora["rows_failed"] = sum(out.finish_reason == "error" for out in outputs)
    base, _ = run_workload(llm, workload, f"{label} base", show_progress, sampling)
    return {"lora": lora, "base": base, "lora_over_base": lora["output_tok_s"] / base["output_tok_s"]}
