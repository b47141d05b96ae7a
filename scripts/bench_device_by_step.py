"""Device time of every step of the `nanovllm bench` default workload against that step's roofline, by step kind.

`bench` sets the whole run against one roofline; this shows which steps fall short of theirs. Each step's bound
is what bench's roofline counts, per step: the weights (this rank's shard) plus the KV context its sequences
attend to, over the measured copy bandwidth, plus its matmul and causal-attention FLOPs over the measured bf16
matmul rate. Runs the workload (256 requests, lengths U[100, 1024], seed 0) in the sync and the async loop after
bench's warm-up and prints one JSON line: per kind [steps, device s, roofline s, roofline / device].

    python scripts/bench_device_by_step.py [--model qwen3-0.6b] [--num-seqs 256] [--max-len 1024]
"""
import argparse
import json

import numpy as np
from bench_setup import add_workload_arguments, warmed_up_engine

from nanovllm import LLM
from nanovllm_cli.bench import run_workload
from nanovllm_cli.roofline import measure_ceilings

DECODE_RANGES = ((1, 16), (17, 64), (65, 128), (129, 192), (193, 256), (257, 512), (513, 1024))


def record_steps(llm: LLM, records: list) -> None:
    """Append (batch size, prefill tokens, tokens, KV tokens attended, attention pairs of prefill chunks,
    device s) of every step the engine completes."""
    finish = llm._loop._finish

    def recording(launched):
        before = llm.stats.device_s or 0.0
        finished = finish(launched)
        batch = launched.batch
        starts = np.asarray(batch.start_positions, dtype=np.int64)
        if batch.num_prefill_tokens:
            new = np.asarray(batch.num_new_tokens, dtype=np.int64)
            pairs = int((new * starts + new * (new + 1) // 2)[new > 1].sum())
        else:  # a steady decode plan's chunk lengths are all 1
            new, pairs = np.ones_like(starts), 0
        records.append((len(batch), batch.num_prefill_tokens, int(new.sum()), int((starts + new).sum()), pairs,
                        (llm.stats.device_s or 0.0) - before))
        return finished

    llm._loop._finish = recording


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    args = parser.parse_args()
    llm, workload = warmed_up_engine(args)
    costs = llm.info.costs
    ceilings = measure_ceilings(llm._runner.device)
    records: list = []
    record_steps(llm, records)
    result = {"device": ceilings.name}
    for overlap in (False, True):
        llm.set_async_scheduling(overlap)
        records.clear()
        run_workload(llm, workload, "run", False)
        batch, prefill, tokens, kv_tokens, pairs, device = (np.array(column) for column in zip(*records))
        weight_bytes = np.array([costs.decode_weight_bytes(n) for n in tokens])  # MoE: the experts its tokens select
        bound = ((weight_bytes + kv_tokens * costs.kv_bytes_per_token) / ceilings.copy_bytes_per_s
                 + (tokens * costs.flops_per_token + pairs * costs.attention_flops_per_pair)
                 / ceilings.matmul_flops_per_s)
        kinds = {"prefill or mixed": prefill > 0}
        kinds |= {f"decode {lo}-{hi}": (prefill == 0) & (batch >= lo) & (batch <= hi) for lo, hi in DECODE_RANGES}
        kinds["all"] = np.ones_like(batch, dtype=bool)
        result["async" if overlap else "sync"] = {
            name: [int(mask.sum()), round(float(device[mask].sum()), 4), round(float(bound[mask].sum()), 4),
                   round(float(bound[mask].sum() / device[mask].sum()), 3)]
            for name, mask in kinds.items() if mask.any()}
    llm.exit()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
