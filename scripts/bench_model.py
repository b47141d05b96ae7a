"""Whole-model timings on the GPU for one engine (Qwen3-0.6B shape, dummy weights); prints JSON.

- prefill: one forward of 8 sequences x 1024 new tokens (8k tokens) + their logits, in TFLOP/s of matmul and
  causal-attention work, against the measured bf16 matmul rate;
- decode: one graph-replayed step of 256 sequences (or each of `--decode-batches`) at context 1024, in ms, and the
  KV + weight bytes it must read over the measured copy bandwidth;
- `--profile`: the top CUDA kernels of each (torch.profiler), to say what dominates;
both with the fused small-op kernels (the default) and without them (`fused_ops=False`; not with `--fused-only`),
in one run.
"""
from __future__ import annotations

import argparse
import gc
import json

import torch

from nanovllm import LLM
from nanovllm.attention import AttentionMetadata
from nanovllm_cli.roofline import measure_ceilings, median_cuda_ms, model_costs


def batch_meta(llm: LLM, num_seqs: int, context: int, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 AttentionMetadata]:
    """Sequences of `context` tokens whose last `new_tokens` are computed now, in shuffled cache blocks."""
    runner = llm._runner
    block_size, device = runner.block_size, runner.device
    blocks_per_seq = -(-context // block_size)
    ids = torch.randperm(runner.num_kv_blocks, device=device)[:num_seqs * blocks_per_seq].to(torch.int32)
    tables = ids.view(num_seqs, blocks_per_seq)
    positions = torch.arange(context - new_tokens, context, device=device).repeat(num_seqs)
    rows = torch.arange(num_seqs, device=device).repeat_interleave(new_tokens)
    slots = tables[rows, positions // block_size].long() * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * new_tokens,
        seq_lens=torch.full((num_seqs,), context, device=device, dtype=torch.int32), block_tables=tables,
        max_query_len=new_tokens, max_seq_len=context,
        decode_num_splits=runner.backend.decode_num_splits(num_seqs, context, runner.num_kv_heads))
    input_ids = torch.randint(0, llm.hf_config.vocab_size, (num_seqs * new_tokens,), device=device)
    return input_ids, positions, meta


def top_kernels(fn, count: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    return [{"kernel": e.key[:90], "calls": e.count, "device_ms": e.device_time_total / 1e3} for e in events[:count]]


@torch.inference_mode()
def measure(model_name: str, engine_args: dict, ceilings, profile: bool, decode_batches: list[int]) -> dict:
    llm = LLM(model_name, **engine_args)
    runner, model = llm._runner, llm._runner.model
    costs = model_costs(llm.hf_config, model, runner.dtype)
    report = {"block_size": runner.block_size, "fused_ops": engine_args["fused_ops"]}

    num_seqs, length = 8, 1024
    prefill_ids, prefill_positions, prefill_meta = batch_meta(llm, num_seqs, length, length)
    last = prefill_meta.query_start_loc[1:].long() - 1

    def prefill():
        return model.compute_logits(model(prefill_ids, prefill_positions, prefill_meta)[last])

    prefill_ms = median_cuda_ms(prefill, repeats=20)
    tokens = num_seqs * length
    flops = tokens * costs.flops_per_token + num_seqs * length * (length + 1) // 2 * costs.attention_flops_per_pair
    report["prefill"] = {"tokens": tokens, "ms": prefill_ms, "tflop_s": flops / prefill_ms / 1e9,
                         "matmul_rate_frac": flops / prefill_ms * 1e3 / ceilings.matmul_flops_per_s}

    report["decode"] = [decode_step(llm, costs, ceilings, batch, 1024, profile) for batch in decode_batches]
    if profile:
        report["prefill"]["top_kernels"] = top_kernels(prefill)
    llm.exit()
    return report


def decode_step(llm: LLM, costs, ceilings, batch: int, context: int, profile: bool) -> dict:
    runner = llm._runner
    ids, positions, meta = batch_meta(llm, batch, context, 1)
    size = runner.graphs.batch_size_for(batch)
    assert size == batch, "the decode batch must be a captured graph size (no padding rows)"
    # The graph's inputs, in the buffers it captured: the sequences' tables in rows 0..batch-1 of the device
    # tables, and table updates that all write the sink row.
    buffers = runner.buffers.on_device
    buffers["input_ids"][:batch] = ids
    buffers["positions"][:batch] = positions
    buffers["slot_mapping"][:batch] = meta.slot_mapping
    buffers["seq_lens"][:batch] = meta.seq_lens
    buffers["rows"][:batch] = torch.arange(batch, device=ids.device)
    runner.tables.tables[:batch, :meta.block_tables.shape[1]] = meta.block_tables
    updates = buffers["table_updates"][:2 * size].view(2, size)
    updates[0].fill_(runner.tables.sink_index)
    updates[1].zero_()

    def decode():
        return runner.graphs.replay(size)

    decode_ms = median_cuda_ms(decode, repeats=20)
    bytes_read = batch * context * costs.kv_bytes_per_token + costs.weight_bytes_per_step
    report = {"batch": batch, "context": context, "ms": decode_ms, "bytes_read_per_s": bytes_read / decode_ms * 1e3,
              "bandwidth_frac": bytes_read / decode_ms * 1e3 / ceilings.copy_bytes_per_s}
    if profile:
        report["top_kernels"] = top_kernels(decode)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[256])
    parser.add_argument("--fused-only", action="store_true")
    args = parser.parse_args()
    # Room for the decode batch (256 x 1024 tokens) without profiling memory, so both engines get the same cache.
    engine_args = dict(load_format="dummy", max_model_len=2048, num_kv_blocks=(256 * 1024 + 8 * 1024) // 16 + 64)
    if args.block_size:
        engine_args["block_size"] = args.block_size
        engine_args["num_kv_blocks"] = (256 * 1024 + 8 * 1024) // args.block_size + 64
    ceilings = measure_ceilings(torch.device("cuda"))
    report = {"device": ceilings.name, "copy_bytes_per_s": ceilings.copy_bytes_per_s,
              "matmul_flops_per_s": ceilings.matmul_flops_per_s}
    for fused in (True,) if args.fused_only else (True, False):  # the small ops fused (default), as torch ops
        report["fused" if fused else "unfused"] = measure(args.model, {**engine_args, "fused_ops": fused}, ceilings,
                                                          args.profile, args.decode_batches)
        gc.collect()
        torch.cuda.empty_cache()
    if not args.fused_only:
        report["fused_speedup"] = {
            "prefill": report["unfused"]["prefill"]["ms"] / report["fused"]["prefill"]["ms"],
            "decode": [u["ms"] / f["ms"] for u, f in zip(report["unfused"]["decode"], report["fused"]["decode"])]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
