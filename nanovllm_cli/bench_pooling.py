"""`nanovllm bench --task embed|classify|score|reward`: offline throughput of a pooling model, in rows/s and input
tokens/s over the wall clock of its steps, set against its prefill roofline on a GPU.

The workload: rows of random token ids (no prefix-cache hits), lengths uniform in the range, each a request of
the task. A pooling row is only prefilled, so its roofline is compute: the matmul FLOPs of every input token
(2 x the weights' matmul parameters) plus attention's (QK^T and PV of every query-key pair: a decoder's causal
pairs, an encoder's every pair) at the device's measured bf16 matmul rate (roofline.py)."""
from __future__ import annotations

import json
import random

import typer

from nanovllm_cli import options as o
from nanovllm_cli.options import EngineOptions


def prefill_roofline_seconds(costs, prompt_lens: list[int], bidirectional: bool, matmul_flops_per_s: float) -> float:
    """The least time the rows' prefill takes: their matmul FLOPs at the matmul rate."""
    pairs = sum(p * p if bidirectional else p * (p + 1) // 2 for p in prompt_lens)
    return (sum(prompt_lens) * costs.flops_per_token + pairs * costs.attention_flops_per_pair) / matmul_flops_per_s


def random_rows(num_rows: int, length_range: tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(*length_range))] for _ in range(num_rows)]


def pool_rows(llm, rows: list[list[int]], task: str) -> dict:
    """Every row through the engine as a `task` request; the engine's step stats."""
    from nanovllm import PoolingParams

    llm.reset_prefix_cache()
    llm.reset_stats()
    params = PoolingParams(task=task)
    for row in rows:
        llm.add_request(None, params, prompt_token_ids=row)
    failed = 0
    while llm.has_unfinished_requests():
        failed += sum(output.error is not None for output in llm.step())
    return {**llm.report()["steps"], "rows_failed": failed}


def pooling_bench(engine: EngineOptions, num_seqs: int, input_len_range: tuple[int, int], seed: int, warmup: bool,
                  json_output: bool) -> None:
    """Measure, report (a table, or one JSON object with --json) and exit."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from nanovllm_cli.roofline import measure_ceilings

    lo, hi = input_len_range
    if not 1 <= lo <= hi:
        raise o.fail(f"--input-len-range needs 1 <= LO <= HI, got {lo} {hi}")
    if engine.data_parallel_size > 1:
        raise o.fail("bench --task measures one engine: drop --data-parallel-size")
    llm = o.load_llm(engine)
    info = llm.info
    spec = info.pooling
    if spec is None:
        llm.exit()
        raise o.fail(f"--task {engine.task}: model {info.model} does not pool")
    if hi > info.max_model_len:
        llm.exit()
        raise o.fail(f"--input-len-range reaches {hi} tokens, beyond max_model_len={info.max_model_len}")
    try:
        rows = random_rows(num_seqs, input_len_range, info.vocab_size, seed)
        if warmup:  # first-use costs (kernels compiled or tuned at each shape) before the measured run
            pool_rows(llm, random_rows(min(num_seqs, 4 * info.max_num_seqs), input_len_range, info.vocab_size,
                                       seed + 1), spec.task)
        stats = pool_rows(llm, rows, spec.task)
    finally:
        llm.exit()
    # After the engine is gone: the measurement's buffers need the memory it held.
    ceilings = measure_ceilings(torch.device(info.device)) if info.device.startswith("cuda") else None
    prompt_lens = [len(row) for row in rows]
    wall = stats["wall_s"]
    figures = {"rows": len(rows), "prompt_tokens": sum(prompt_lens), "steps": stats["steps"], "wall_s": wall,
               "rows_per_s": len(rows) / wall, "tokens_per_s": sum(prompt_lens) / wall,
               "gpu_busy_frac": stats["gpu_busy_frac"], "rows_failed": stats["rows_failed"],
               "roofline_s": None, "roofline_frac": None}
    if ceilings is not None:
        figures["roofline_s"] = prefill_roofline_seconds(info.costs, prompt_lens, spec.encoder,
                                                         ceilings.matmul_flops_per_s)
        figures["roofline_frac"] = figures["roofline_s"] / wall
    report = {"model": info.model, "task": spec.task, "device": ceilings.name if ceilings else info.device,
              "workload": {"rows": len(rows), "input_len_range": list(input_len_range), "seed": seed},
              "engine": {"dtype": info.dtype, "max_num_seqs": info.max_num_seqs,
                         "max_num_batched_tokens": info.max_num_batched_tokens, "num_kv_blocks": info.num_kv_blocks,
                         "async_scheduling": engine.async_scheduling, "attention_backend": info.attention_backend,
                         "torch": torch.__version__},
              "ceilings": {"matmul_bf16_flops_per_s": ceilings.matmul_flops_per_s} if ceilings else None,
              "results": figures}
    if json_output:
        typer.echo(json.dumps(report))
        return
    table = Table(title=f"nanovllm bench --task {spec.task} — {report['model']} on {report['device']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in figures.items():
        table.add_row(name, "-" if value is None else f"{value:,.4g}" if isinstance(value, float) else f"{value:,}")
    Console().print(table)
