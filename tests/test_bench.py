"""`nanovllm bench`: the JSON schema of --compare, honest CPU figures, the workload and the roofline arithmetic."""
import json

from typer.testing import CliRunner

from nanovllm import LLM, CostModel
from nanovllm.models.costs import WeightCosts
from nanovllm.runner.cuda_graphs import batch_size_ladder
from nanovllm_cli.bench import run_workload, synthetic_workload, warmup_workload
from nanovllm_cli.main import app
from nanovllm_cli.roofline import DeviceCeilings, roofline_seconds

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


def test_roofline_by_hand():
    """Two sequences (prompt 3, 2 outputs) and (prompt 1, 3 outputs), batch limit 1 (two waves).
    KV tokens read by decode (a step writes its token, then attends to it too): A reads 4 once; B reads 2 then 3
    -> 9 tokens. Decode steps: 2 waves x
    (3 - 1) = 4. Prefill FLOPs: (3 + 1) tokens x 10 + causal pairs (6 + 1) x 2."""
    costs = CostModel(kv_bytes_per_token=100, attention_flops_per_pair=2,
                      weights=WeightCosts(shared_bytes=1000, shared_matmul_params=5, expert_layers=()))
    ceilings = DeviceCeilings("test", copy_bytes_per_s=1e4, matmul_flops_per_s=1e2)
    expected = (9 * 100 + 4 * 1000) / 1e4 + (4 * 10 + 7 * 2) / 1e2
    assert abs(roofline_seconds(costs, [3, 1], [2, 3], 1, ceilings) - expected) < 1e-12


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
