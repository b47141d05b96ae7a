"""`nanovllm bench`: the JSON of --compare, honest CPU figures, the workloads and their length distributions, the
ideal continuous-batching schedule behind the roofline (against a hand-made schedule, closed forms and a step by
step reference), occupancy and step kinds from the engine's step trace, rounds, the plot file and the matrices."""
import json
import random
import statistics
import time
from collections import deque

import numpy as np
import pytest
import torch
from conftest import PRESETS
from transformers import AutoConfig
from typer.testing import CliRunner

from nanovllm import LLM, CostModel
from nanovllm.engine.stats import StepTrace, batch_occupancy, step_counts
from nanovllm.models.costs import WeightCosts
from nanovllm.models.registry import model_class_for
from nanovllm.runner.cuda_graphs import batch_size_ladder
from nanovllm_cli.bench import over_rounds, run_lengths
from nanovllm_cli.bench_matrix import CONSTRAINT_KINDS, ratio_table, sampling_settings
from nanovllm_cli.bench_workload import (
    SHAREGPT_LIKE,
    LengthDistribution,
    lengths_from_options,
    run_workload,
    synthetic_workload,
    warmup_workload,
)
from nanovllm_cli.main import app
from nanovllm_cli.roofline import DeviceCeilings, ideal_schedule, roofline_seconds, slot_starts

TINY = ["--model", "tiny-qwen3", "--load-format", "dummy", "--max-model-len", "256"]
MODE_KEYS = {"requests", "prompt_tokens", "output_tokens", "wall_s", "output_tok_s", "total_tok_s", "steps",
             "gpu_busy_s", "gpu_busy_frac", "cpu_schedule_s", "cpu_prepare_s", "cpu_postprocess_s", "ttft_p50_s",
             "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "roofline_s", "roofline_frac", "mean_running_rows",
             "full_batch_decode_share", "tail_below_half_steps", "tail_below_half_s", "steps_decode_only",
             "steps_mixed", "steps_prefill_only", "steps_graph", "steps_eager", "rounds"}


def bench(*args):
    result = CliRunner().invoke(app, ["bench", *(str(a) for a in args)])
    return result


# ---- the command --------------------------------------------------------------------------------------------------

def test_compare_json_schema_on_cpu():
    result = bench(*TINY, "--num-seqs", 6, "--input-len-range", 5, 40, "--output-len-range", 3, 12,
                   "--max-num-seqs", 4, "--compare", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    workload = synthetic_workload(6, (5, 40), (3, 12), 512, 0)
    assert report["workload"]["prompt_tokens"] == sum(workload.prompt_lens)
    assert report["workload"]["source"]["input_lengths"] == "uniform:5,40"
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
        kinds = stats["steps_decode_only"] + stats["steps_mixed"] + stats["steps_prefill_only"]
        assert kinds == stats["steps"] == stats["steps_eager"] and stats["steps_graph"] == 0  # no graphs on the CPU
        assert 0 < stats["mean_running_rows"] <= 4 and 0 <= stats["full_batch_decode_share"] <= 1
    assert report["async_over_sync"] == report["modes"]["async"]["output_tok_s"] / report["modes"]["sync"][
        "output_tok_s"]


def test_bad_options_are_usage_errors():
    for args, message in [
        (["--input-len-range", 50, 10], "input-len-range"),
        (["--input-len", 10, "--input-dist", "fixed:3"], "--input-len and --input-dist both set the input lengths"),
        (["--output-dist", "lognormal:150"], "lognormal takes MEDIAN,SIGMA"),
        (["--output-dist", "poisson:3"], "uniform:LO,HI | lognormal:MEDIAN,SIGMA | fixed:N"),
        (["--dataset-name", "alpaca"], "use random or sharegpt"),
        (["--random-range-ratio", 1.0, "--input-len", 8], "--random-range-ratio must be in [0, 1)"),
        (["--rounds", 0], "--rounds must be at least 1"),
        (["--sampling-matrix", "--structured-matrix"], "keep one"),
        (["--sampling-matrix", "--temperature", 0.5], "--sampling-matrix runs its own settings"),
        (["--plot", "out.svg"], "must end in .png or .html"),
        (["--plot", "no/such/dir/out.png"], "create it first"),
    ]:
        result = bench("--model", "tiny-qwen3", "--load-format", "dummy", *args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_missing_matplotlib_is_named(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    result = bench("--model", "tiny-qwen3", "--load-format", "dummy", "--plot", tmp_path / "out.png")
    assert result.exit_code == 2 and "pip install 'nanovllm[plot]'" in result.output


def test_sharegpt_preset_and_vllm_names_build_the_workload(tmp_path):
    """--dataset-name sharegpt draws both sides from the preset; --output-len (vLLM's) overrides one side;
    --num-prompts and --num-seqs are one option; --save-workload writes rows that --dataset replays."""
    saved = tmp_path / "rows.jsonl"
    result = bench(*TINY, "--dataset-name", "sharegpt", "--num-prompts", 5, "--input-dist", "lognormal:20,0.9:4,60",
                   "--output-len", 3, "--no-warmup", "--save-workload", saved, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["workload"]["source"] == {"dataset_name": "sharegpt", "input_lengths": "lognormal:20,0.9:4,60",
                                            "output_lengths": "fixed:3", "seed": 0}
    expected = synthetic_workload(5, LengthDistribution("lognormal", (20, 0.9), 4, 60),
                                  LengthDistribution("fixed", (3,)), 512, 0)
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [r["prompt_token_ids"] for r in rows] == expected.prompts and [r["max_tokens"] for r in rows] == [3] * 5
    replay = bench(*TINY, "--dataset", saved, "--no-warmup", "--json")
    assert replay.exit_code == 0, replay.output
    assert json.loads(replay.stdout)["workload"]["prompt_tokens"] == sum(expected.prompt_lens)
    conflict = bench(*TINY, "--dataset", saved, "--num-seqs", 3)
    assert conflict.exit_code == 2 and "--dataset takes its rows" in conflict.output


def test_rounds_report_median_and_spread_and_the_plot_is_written(tmp_path):
    plot = tmp_path / "run.png"
    result = bench(*TINY, "--num-seqs", 4, "--input-len", 6, "--output-len", 4, "--no-warmup", "--rounds", 3,
                   "--plot", plot, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["rounds"] == 3
    stats = report["modes"]["sync"]
    for key in ("output_tok_s", "total_tok_s", "prefill_tok_s"):
        spread = stats["rounds"][key]
        assert len(spread["values"]) == 3 and spread["median"] == statistics.median(spread["values"]) == stats[key]
        assert spread["spread"] == pytest.approx((max(spread["values"]) - min(spread["values"])) / spread["median"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(plot.with_suffix(".json").read_text()) == report
    page = tmp_path / "run.html"
    result = bench(*TINY, "--num-seqs", 3, "--input-len", 6, "--output-len", 3, "--no-warmup", "--compare",
                   "--plot", page)
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "<svg" in text and "async loop" in text


def test_over_rounds_takes_the_median_round():
    runs = [{"output_tok_s": v, "total_tok_s": 2 * v, "prefill_tok_s": None, "wall_s": 10 / v} for v in (3.0, 1.0, 2.0)]
    merged, middle = over_rounds(runs)
    assert middle == 2 and merged["wall_s"] == 5.0 and merged["output_tok_s"] == 2.0 and merged["total_tok_s"] == 4.0
    assert merged["rounds"]["output_tok_s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "spread": 1.0,
                                                "values": [3.0, 1.0, 2.0]}
    assert "prefill_tok_s" not in merged["rounds"]  # not measured: no spread to report


# ---- workloads and lengths ----------------------------------------------------------------------------------------

def test_uniform_workload_is_the_same_rows_as_drawn_one_by_one():
    """A (LO, HI) pair is uniform and draws as bench always has: each prompt's length then its ids, then the
    output lengths, from one seeded generator (so a seed's default workload stays the same rows)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(100, 200))] for _ in range(50)]
    outputs = [rng.randint(7, 9) for _ in range(50)]
    workload = synthetic_workload(50, (100, 200), (7, 9), 1000, 3)
    assert workload.prompts == prompts and workload.output_lens == outputs


def test_length_distributions_clip_and_keep_their_median():
    lengths = SHAREGPT_LIKE.sample(20_001, seed=1)
    assert min(lengths) >= 4 and max(lengths) <= 1024
    assert abs(statistics.median(lengths) - 150) <= 4
    # the preset's shape: the mean and the share at the cap that numpy's lognormal gives for the same law
    reference = np.clip(np.rint(150 * np.exp(0.9 * np.random.default_rng(0).standard_normal(400_000))), 4, 1024)
    assert statistics.mean(lengths) == pytest.approx(reference.mean(), rel=0.03)
    assert lengths.count(1024) / len(lengths) == pytest.approx((reference == 1024).mean(), abs=0.004)
    narrow = LengthDistribution.parse("lognormal:150,2.0:100,200").sample(2000, seed=2)
    assert {min(narrow), max(narrow)} == {100, 200}  # both ends clip
    assert set(LengthDistribution.parse("fixed:7").sample(20, seed=0)) == {7}
    assert set(LengthDistribution.parse("fixed:7:10,20").sample(5, seed=0)) == {10}
    spread = LengthDistribution.parse("uniform:10,20").sample(3000, seed=0)
    assert set(spread) == set(range(10, 21))


def test_length_specs_parse_back_and_reject_bad_values():
    for text in ("uniform:100,1024", "lognormal:150,0.9:4,1024", "fixed:64", "lognormal:50,1.5:4,"):
        assert LengthDistribution.parse(text).spec == text
    for text, message in [("uniform:10,5", "needs integers 1 <= LO <= HI"), ("lognormal:0,1", "MEDIAN > 0"),
                          ("fixed:2.5", "integer N >= 1"), ("fixed:3:9,2", "1 <= MIN <= MAX"),
                          ("fixed:a", "numbers for ARGS"), ("uniform", "is not a length distribution")]:
        with pytest.raises(ValueError, match=message):
            LengthDistribution.parse(text)


def test_lengths_from_options_follow_vllm():
    default = SHAREGPT_LIKE
    assert lengths_from_options("input", None, 0.0, None, None, default) is default
    assert lengths_from_options("input", 512, 0.0, None, None, default).spec == "fixed:512"
    assert lengths_from_options("input", 100, 0.5, None, None, default).spec == "uniform:50,150"  # N (1 -+ R)
    assert lengths_from_options("output", None, 0.0, (3, 9), None, default).spec == "uniform:3,9"
    with pytest.raises(ValueError, match="--output-len and --output-len-range both"):
        lengths_from_options("output", 5, 0.0, (3, 9), None, default)


def test_warmup_passes_every_decode_graph_size():
    """Each CUDA graph's first launch (and each Triton variant's compile) must happen in the warm-up, not in
    the first measured loop: the warm-up's decode steps reach every size of the graph ladder."""
    llm = LLM("tiny-qwen3", load_format="dummy", max_model_len=256, max_num_seqs=64, cpu_kv_cache_bytes=1 << 24)
    run_workload(llm, warmup_workload(llm, 0), "warm-up", False)
    ladder = batch_size_ladder(64)
    reached = {next(size for size in ladder if size >= batch) for batch, _ in llm.stats.decode_host_s}
    assert reached == set(ladder)


def test_sampling_options_reach_the_requests():
    args = [*TINY, "--num-seqs", 3, "--input-len-range", 5, 20, "--output-len-range", 3, 6, "--no-warmup", "--json",
            "--temperature", 0.8, "--top-p", 0.95, "--top-k", 50, "--min-p", 0.01, "--logprobs", 5]
    result = bench(*args)
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
    workload = synthetic_workload(2, (5, 9), (2, 3), 512, 0)
    _, outputs = run_workload(llm, workload, "x", False, {"temperature": 0.8, "logprobs": 5})
    assert [(p.temperature, p.logprobs, p.ignore_eos) for p in seen] == [(0.8, 5, True)] * 2
    assert run_lengths(outputs) == (workload.prompt_lens, workload.output_lens)  # what the roofline schedules
    seen.clear()
    run_workload(llm, workload, "x", False, [{"temperature": 0.5}, {"temperature": 0.0, "n": 2}])  # one per row
    assert [(p.temperature, p.n) for p in seen] == [(0.5, 1), (0.0, 2)]


def test_bad_sampling_option_is_a_usage_error():
    result = bench("--model", "tiny-qwen3", "--load-format", "dummy", "--logprobs", 99)
    assert result.exit_code == 2 and "--logprobs" in result.output


# ---- the ideal schedule -------------------------------------------------------------------------------------------

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


def test_llama_3_1_8b_preset_has_its_published_size():
    """The preset of the Llama-3.1-8B shape builds (llama3 rope scaling included) with Meta's published
    8,030,261,248 parameters."""
    config = AutoConfig.for_model(**json.loads((PRESETS / "llama-3.1-8b.json").read_text()))
    assert config.rope_scaling["rope_type"] == "llama3" and config.max_position_embeddings == 131072
    with torch.device("meta"):
        model = model_class_for(config)(config)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


# ---- occupancy and step kinds -------------------------------------------------------------------------------------

def hand_trace() -> StepTrace:
    """(ended at, rows, prompt tokens, decoding rows, graph): prefill only, decode, mixed, then the batch of 4
    drains: 3, 2 (the last step at half), 1, 1."""
    trace = StepTrace()
    for ended, rows, prefill, decoding, graph in [(1.0, 4, 40, 0, False), (1.5, 4, 0, 4, True), (2.0, 4, 10, 3, False),
                                                 (2.5, 3, 0, 3, True), (3.0, 2, 0, 2, True), (3.2, 1, 0, 1, True),
                                                 (3.6, 1, 0, 1, True)]:
        trace.append(ended, rows, prefill, decoding, None, graph)
    return trace


def test_step_kinds_and_occupancy_of_a_hand_made_trace():
    trace = hand_trace()
    assert step_counts(trace) == {"steps_decode_only": 5, "steps_mixed": 1, "steps_prefill_only": 1,
                                  "steps_graph": 5, "steps_eager": 2}
    occupancy = batch_occupancy(trace, 4, started_at=0.0)
    assert occupancy["mean_running_rows"] == pytest.approx(19 / 7)
    assert occupancy["full_batch_decode_share"] == pytest.approx(2 / 6)  # steps 1 and 2 of the 6 that decode
    assert occupancy["tail_below_half_steps"] == 2 and occupancy["tail_below_half_s"] == pytest.approx(0.6)
    assert trace.step_seconds(0.0).tolist() == pytest.approx([1.0, 0.5, 0.5, 0.5, 0.5, 0.2, 0.4])
    never_half = batch_occupancy(trace, 10, started_at=0.5)
    assert never_half["tail_below_half_steps"] == 7 and never_half["tail_below_half_s"] == pytest.approx(3.1)
    assert never_half["full_batch_decode_share"] == 0


def test_engine_trace_counts_its_steps():
    """The engine's own trace: every step once, its decoding rows adding up to the decode tokens, prompts to the
    prefill tokens; the summary's kinds from it."""
    llm = LLM("tiny-qwen3", load_format="dummy", max_model_len=256, max_num_seqs=4, num_kv_blocks=64)
    stats, _ = run_workload(llm, synthetic_workload(7, (5, 30), (2, 9), 512, 1), "x", False)
    timeline = llm.stats.timeline()
    assert len(timeline["t"]) == stats["steps"] and np.all(np.diff(timeline["t"]) >= 0)
    assert timeline["decode_rows"].sum() == llm.stats.decode_tokens
    assert timeline["prefill_tokens"].sum() == llm.stats.prefill_tokens
    assert timeline["rows"].max() <= 4 and not timeline["graph"].any()
    assert stats["steps_prefill_only"] == int((timeline["kind"] == 2).sum()) >= 1
    assert stats["mean_running_rows"] == pytest.approx(timeline["rows"].mean())


# ---- matrices -----------------------------------------------------------------------------------------------------

def test_ratio_table_takes_medians_and_the_minimum():
    cells = {"sync": {"a": [(9.0, 10.0), (8.0, 10.0), (10.0, 10.0)], "b": [(5.0, 4.0)]},
             "async": {"a": [(7.0, 10.0), (9.5, 10.0)]}}
    table = ratio_table(cells)
    assert table["loops"]["sync"]["a"]["ratio"] == pytest.approx(0.9)
    assert table["loops"]["sync"]["b"]["ratios"] == [1.25]
    assert table["loops"]["async"]["a"]["ratio"] == pytest.approx(0.825)
    assert table["min_ratio"] == pytest.approx(0.825) and table["min_at"] == {"loop": "async", "setting": "a"}


def check_matrix(matrix: dict, loops: set[str], names: list[str], rounds: int) -> None:
    assert set(matrix["loops"]) == loops
    ratios = []
    for entries in matrix["loops"].values():
        assert list(entries) == names
        for cell in entries.values():
            assert len(cell["ratios"]) == rounds and all(r > 0 for r in cell["ratios"])
            assert cell["ratios"] == pytest.approx([v / b for v, b in zip(cell["output_tok_s"], cell["baseline_tok_s"])])
            assert cell["ratio"] == statistics.median(cell["ratios"])
            ratios.append(cell["ratio"])
    assert matrix["min_ratio"] == min(ratios)
    at = matrix["min_at"]
    assert matrix["loops"][at["loop"]][at["setting"]]["ratio"] == matrix["min_ratio"]


def test_sampling_matrix_on_a_tiny_model():
    result = bench(*TINY, "--num-prompts", 4, "--input-len", 6, "--output-len", 3, "--no-warmup",
                   "--sampling-matrix", "--json")
    assert result.exit_code == 0, result.output
    matrix = json.loads(result.stdout)["sampling_matrix"]
    names = [name for name in sampling_settings(512, 0) if name != "greedy"]
    assert len(names) == 9 and matrix["baseline"] == "greedy"
    check_matrix(matrix, {"sync"}, names, rounds=2)  # the engine's loop; two rounds unless told
    assert matrix["settings"]["n4"]["n"] == 4 and matrix["settings"]["logit_bias64"]["logit_bias"] == "64 token ids"


def structured_matrix(model, *args):
    result = bench("--model", model, "--max-model-len", 256, "--num-prompts", 2, "--input-len", 5, "--output-len", 8,
                   "--no-warmup", "--rounds", 1, "--temperature", 0.8, "--structured-matrix", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["structured_matrix"]


def test_structured_matrix_on_a_tiny_model(text_model):
    matrix = structured_matrix(text_model, "--matrix-only", "choice,per_row_schemas")
    check_matrix(matrix, {"sync", "async"}, ["choice", "per_row_schemas"], rounds=1)
    for entries in matrix["loops"].values():
        assert all(cell["rows_failed"] == [0] and 0 < cell["mean_output_tokens"][0] <= 8 for cell in entries.values())
        assert entries["choice"]["rows_complete"] == [2]  # a label is a few tokens: complete within 8
    no_tokenizer = bench(*TINY, "--structured-matrix")
    assert no_tokenizer.exit_code == 2 and "tokenized_preset.py" in no_tokenizer.output
    unknown = bench(*TINY, "--structured-matrix", "--matrix-only", "choice,xml")
    assert unknown.exit_code == 2 and "unknown 'xml'; choose from choice, regex" in unknown.output


@pytest.mark.slow
def test_every_kind_of_the_structured_matrix(text_model):
    check_matrix(structured_matrix(text_model), {"sync", "async"}, list(CONSTRAINT_KINDS), rounds=1)
