"""`nanovllm bench`: the JSON schema of --compare, honest CPU figures, the workload and the ideal continuous-batching
schedule behind the roofline (against a hand-made schedule, closed forms and a step by step reference)."""
import json
import random
import time
from collections import deque

import numpy as np
import pytest
from typer.testing import CliRunner

from nanovllm import LLM, CostModel
from nanovllm.models.costs import WeightCosts
from nanovllm.runner.cuda_graphs import batch_size_ladder
from nanovllm_cli.bench import run_workload, synthetic_workload, warmup_workload
from nanovllm_cli.main import app
from nanovllm_cli.roofline import DeviceCeilings, ideal_schedule, roofline_seconds, slot_starts

MODE_KEYS = {"requests", "prompt_tokens", "output_tokens", "wall_s", "output_tok_s", "total_tok_s", "steps",
             "gpu_busy_s", "gpu_busy_frac", "cpu_schedule_s", "cpu_prepare_s", "cpu_postprocess_s", "ttft_p50_s",
             "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "roofline_s", "roofline_frac"}


def test_compare_json_schema_on_cpu():
    args = ["bench", "--model", "tiny-qwen3", "--load-format", "dummy", "--max-model-len", "256", "--num-seqs", "6",
            "--input-len-range", "5", "40", "--output-len-range", "3", "12", "--compare", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    workload = synthetic_workload(6, (5, 40), (3, 12), 512, 0)
    assert report["workload"]["prompt_tokens"] == sum(workload.prompt_lens)
    assert report["device"] == "cpu" and report["ceilings"] is None
    assert set(report["modes"]) == {"sync", "async"}
    for mode, stats in report["modes"].items():
        assert MODE_KEYS <= set(stats)
        assert stats["loop"] == mode and stats["overlap"] is False  # nothing to overlap with on the CPU
        assert stats["requests"] == 6 and stats["output_tokens"] == sum(workload.output_lens)
        assert stats["prompt_tokens"] == sum(workload.prompt_lens)
        for gpu_only in ("gpu_busy_s", "gpu_busy_frac", "gpu_idle_frac", "roofline_s", "roofline_frac"):
            assert stats[gpu_only] is None
        phases = stats["cpu_schedule_s"] + stats["cpu_prepare_s"] + stats["cpu_postprocess_s"]
        assert 0 < phases <= stats["wall_s"]
        assert stats["output_tok_s"] == stats["output_tokens"] / stats["wall_s"]
    assert report["async_over_sync"] == report["modes"]["async"]["output_tok_s"] / report["modes"]["sync"][
        "output_tok_s"]


def test_bad_range_is_a_usage_error():
    result = CliRunner().invoke(app, ["bench", "--model", "tiny-qwen3", "--input-len-range", "50", "10"])
    assert result.exit_code == 2 and "input-len-range" in result.output


def test_synthetic_workload_is_seeded_and_in_range():
    a, b = synthetic_workload(50, (100, 200), (7, 9), 1000, 3), synthetic_workload(50, (100, 200), (7, 9), 1000, 3)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert all(100 <= n <= 200 for n in a.prompt_lens) and all(7 <= n <= 9 for n in a.output_lens)
    assert all(0 <= t < 1000 for p in a.prompts for t in p)


COSTS = CostModel(kv_bytes_per_token=10, attention_flops_per_pair=1,
                  weights=WeightCosts(shared_bytes=300, shared_matmul_params=1, expert_layers=()))  # 2 FLOPs a token
CEILINGS = DeviceCeilings("test", copy_bytes_per_s=100, matmul_flops_per_s=5)


def test_ideal_schedule_by_hand():
    """Batch 2; rows A (prompt 2, 3 outputs), B (1, 1), C (4, 2). Step 0: A and B prefill (3 tokens, 3 + 1
    attention pairs): 300 B -> 3.0 s, 10 FLOPs -> 2.0 s. B is done (its prefill sampled its only token), so C
    takes its slot. Step 1: A decodes (context 3), C prefills (4 tokens, 10 pairs): 330 B -> 3.3 s, 5 tokens x 2
    + 13 pairs = 23 FLOPs -> 4.6 s. Step 2: A (context 4) and C (context 5) decode: 390 B -> 3.9 s, 13 FLOPs ->
    2.6 s. Total 3.0 + 4.6 + 3.9."""
    schedule = ideal_schedule(COSTS, [2, 1, 4], [3, 1, 2], 2, CEILINGS)
    assert schedule.rows.tolist() == [2, 2, 2] and schedule.decode_rows.tolist() == [0, 1, 2]
    assert schedule.prefill_tokens.tolist() == [3, 4, 0] and schedule.kv_tokens.tolist() == [0, 3, 9]
    assert schedule.step_s.tolist() == pytest.approx([3.0, 4.6, 3.9])
    assert roofline_seconds(COSTS, [2, 1, 4], [3, 1, 2], 2, CEILINGS) == pytest.approx(11.5)
    assert slot_starts(np.array([3, 1, 2]), 2).tolist() == [0, 0, 1]


def test_equal_lengths_run_in_waves():
    """12 rows of prompt 50 and 20 outputs at batch 4: three waves of one prefill step (compute-bound here) and
    19 decode steps (bound by their bytes), in closed form."""
    costs = CostModel(kv_bytes_per_token=1000, attention_flops_per_pair=100,
                      weights=WeightCosts(shared_bytes=10**6, shared_matmul_params=10**4, expert_layers=()))
    ceilings = DeviceCeilings("test", copy_bytes_per_s=1e9, matmul_flops_per_s=1e9)
    b, p, n = 4, 50, 20
    prefill = max(1e6 / 1e9, b * (p * 2e4 + p * (p + 1) / 2 * 100) / 1e9)
    decodes = sum(max((1e6 + b * (p + j) * 1000) / 1e9, (b * 2e4 + b * (p + j) * 100) / 1e9) for j in range(1, n))
    assert prefill > 1e6 / 1e9 and decodes == pytest.approx((n - 1) * 1e-3 + b * sum(p + j for j in range(1, n)) * 1e-6)
    schedule = ideal_schedule(costs, [p] * 12, [n] * 12, b, ceilings)
    assert len(schedule.step_s) == 3 * n and set(schedule.rows.tolist()) == {b}
    assert schedule.seconds == pytest.approx(3 * (prefill + decodes), rel=1e-12)


def reference_schedule(prompts: list[int], outputs: list[int], batch: int) -> list[tuple[int, int, int, int]]:
    """Step by step: free slots take the next rows (prefilled in that step), running rows decode one token and
    read their context, a row leaves after its last token. Per step (rows, decoding rows, prompt tokens, KV
    tokens read)."""
    queue, running, steps = deque(range(len(prompts))), {}, []
    while queue or running:
        decoding = list(running)
        for row in decoding:
            running[row] += 1
        admitted = [queue.popleft() for _ in range(min(batch - len(running), len(queue)))]
        running.update((row, 0) for row in admitted)
        steps.append((len(running), len(decoding), sum(prompts[r] for r in admitted),
                      sum(prompts[r] + running[r] for r in decoding)))
        for row in [r for r, done in running.items() if done == outputs[r] - 1]:
            del running[row]
    return steps


def test_ideal_schedule_matches_a_step_by_step_reference():
    rng = random.Random(5)
    for batch in (1, 3, 8):
        prompts = [rng.randint(1, 40) for _ in range(30)]
        outputs = [rng.randint(1, 25) for _ in range(30)]
        schedule = ideal_schedule(COSTS, prompts, outputs, batch, CEILINGS)
        got = list(zip(schedule.rows.tolist(), schedule.decode_rows.tolist(), schedule.prefill_tokens.tolist(),
                       schedule.kv_tokens.tolist()))
        assert got == reference_schedule(prompts, outputs, batch)
        # whatever the schedule, each row reads p + 1 .. p + n - 1 context tokens once
        assert schedule.kv_tokens.sum() == sum((n - 1) * p + n * (n - 1) // 2 for p, n in zip(prompts, outputs))


def test_ideal_schedule_of_100k_rows_is_fast():
    lengths = np.clip(np.rint(150 * np.exp(0.9 * np.random.default_rng(0).standard_normal((2, 100_000)))), 4, 1024)
    started = time.perf_counter()
    schedule = ideal_schedule(COSTS, lengths[0], lengths[1], 256, CEILINGS)
    assert time.perf_counter() - started < 1.0
    assert schedule.decode_rows.sum() == lengths[1].sum() - 100_000


def test_model_costs_are_one_ranks_share_under_tensor_parallelism():
    """TP=2: each rank reads half the KV heads and does half the attention and matmul work (tiny-qwen3's vocab
    and MLP split evenly); its weight read is half the model's plus the norms, which every rank holds whole."""
    engine = {"load_format": "dummy", "max_model_len": 128, "cpu_kv_cache_bytes": 1 << 20}
    single = LLM("tiny-qwen3", **engine)
    whole = single.info.costs
    norm_bytes = sum(p.numel() * p.element_size() for name, p in single._runner.model.named_parameters()
                     if "norm" in name)
    with LLM("tiny-qwen3", tensor_parallel_size=2, **engine) as llm:
        share = llm.info.costs
    assert 2 * share.kv_bytes_per_token == whole.kv_bytes_per_token
    assert 2 * share.attention_flops_per_pair == whole.attention_flops_per_pair
    assert 2 * share.flops_per_token == whole.flops_per_token
    assert 2 * share.weight_bytes_per_step == whole.weight_bytes_per_step + norm_bytes


def test_warmup_passes_every_decode_graph_size():
    """Each CUDA graph's first launch (and each Triton variant's compile) must happen in the warm-up, not in
    the first measured loop: the warm-up's decode steps reach every size of the graph ladder."""
    llm = LLM("tiny-qwen3", load_format="dummy", max_model_len=256, max_num_seqs=64, cpu_kv_cache_bytes=1 << 24)
    run_workload(llm, warmup_workload(llm, 0), "warm-up", False)
    ladder = batch_size_ladder(64)
    reached = {next(size for size in ladder if size >= batch) for batch, _ in llm.stats.decode_host_s}
    assert reached == set(ladder)


def test_sampling_options_reach_the_requests():
    args = ["bench", "--model", "tiny-qwen3", "--load-format", "dummy", "--max-model-len", "256", "--num-seqs", "3",
            "--input-len-range", "5", "20", "--output-len-range", "3", "6", "--no-warmup", "--json",
            "--temperature", "0.8", "--top-p", "0.95", "--top-k", "50", "--min-p", "0.01", "--logprobs", "5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["workload"]["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "min_p": 0.01,
                                              "logprobs": 5}
    llm = LLM("tiny-qwen3", load_format="dummy", max_model_len=256, num_kv_blocks=32)
    seen, add_request = [], llm.add_request

    def recording(prompt, params):
        seen.append(params)
        return add_request(prompt, params)

    llm.add_request = recording
    run_workload(llm, synthetic_workload(2, (5, 9), (2, 3), 512, 0), "x", False, {"temperature": 0.8, "logprobs": 5})
    assert [(p.temperature, p.logprobs, p.ignore_eos) for p in seen] == [(0.8, 5, True)] * 2


def test_bad_sampling_option_is_a_usage_error():
    result = CliRunner().invoke(app, ["bench", "--model", "tiny-qwen3", "--logprobs", "99"])
    assert result.exit_code == 2 and "--logprobs" in result.output
