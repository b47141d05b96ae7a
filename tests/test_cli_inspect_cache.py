"""`nanovllm inspect-cache` against figures computed by hand on small crafted inputs (block size 4).

tiny-qwen3: 2 layers, 2 KV heads of 32 dims, fp32 on the CPU -> a 4-token block holds
2 (K and V) x 2 x 4 x 2 x 32 x 4 bytes = 4096 bytes, and the default 1 GiB CPU budget is 262144 blocks.
"""
import json

from typer.testing import CliRunner

from nanovllm_cli.main import app

P, Q = list(range(1, 9)), list(range(11, 19))  # two 2-block prefixes


def inspect(tmp_path, rows, *args):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = CliRunner().invoke(app, ["inspect-cache", str(path), "--model", "tiny-qwen3", "--block-size", "4",
                                      *map(str, args)])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def report_of(tmp_path, rows, *args):
    result = inspect(tmp_path, rows, "--json", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def ids(*token_ids):
    return {"prompt_token_ids": list(token_ids)}


def test_blocks_shared_prefixes_and_hits(tmp_path):
    rows = [
        ids(*range(1, 11)),  # blocks A=[1-4] B=[5-8], partial [9 10]
        ids(*range(1, 9), 20, 21, 22),  # A B hit (8 tokens), partial
        ids(1, 2, 3, 4, *range(30, 38)),  # A hit (4), then C D: 3 full blocks
        ids(50, 51, 52),  # one partial block
        ids(*range(1, 11)),  # A B hit (8), partial
        {"prompt": "no tokenizer"},  # fails: tiny-qwen3 has none
        ids(*range(40)),  # fails: too long for --max-model-len 32
    ]
    report = report_of(tmp_path, rows, "--max-model-len", 32)
    assert (report["rows"], report["rows_ok"], report["rows_failed"]) == (7, 5, 2)
    assert report["errors"][0].startswith("line 6: ") and "no tokenizer" in report["errors"][0]
    assert report["errors"][1].startswith("line 7: ") and "max_model_len is 32" in report["errors"][1]
    assert report["prompt_tokens"] == 10 + 11 + 12 + 3 + 10
    assert (report["prompt_tokens_min"], report["prompt_tokens_max"]) == (3, 12)
    assert report["blocks_needed"] == 3 + 3 + 3 + 1 + 3
    # distinct full blocks A B C D + 4 partial blocks; the other 5 blocks are shared
    assert (report["unique_blocks"], report["shared_blocks"]) == (8, 5)
    assert (report["bytes_per_block"], report["dtype_bytes"], report["num_blocks"]) == (4096, 4, 262144)
    for order in ("file_order", "prefix_aware"):
        assert report[order]["hit_tokens"] == 8 + 4 + 8
        assert abs(report[order]["hit_rate"] - 20 / 46) < 1e-9
        assert report[order]["evictions"] == 0
    # [1..8] is in 3 rows and saves 2 x 8 tokens; [1..4] is in 4 rows and saves 3 x 4
    assert report["top_prefixes"] == [{"tokens": 8, "rows": 3, "text": "token ids 1 2 3 4 5 6 7 8"},
                                      {"tokens": 4, "rows": 4, "text": "token ids 1 2 3 4"}]
    assert report["histogram"] == [{"min_tokens": 1, "max_tokens": 16, "rows": 5}]


def test_prefix_aware_order_avoids_evictions_in_a_small_cache(tmp_path):
    """Three blocks of cache: P1 Q1 P2 Q2 in file order evict each prefix before its second use."""
    rows = [ids(*P, 21, 22, 23, 24), ids(*Q, 31, 32, 33, 34), ids(*P, 41, 42, 43, 44), ids(*Q, 51, 52, 53, 54)]
    report = report_of(tmp_path, rows, "--num-blocks", 3)
    assert report["num_blocks"] == 3 and report["cache_bytes"] == 3 * 4096
    assert report["file_order"] == {"hit_tokens": 0, "hit_rate": 0.0, "evictions": 9, "rows_not_fitting": 0}
    # P1 P2 Q1 Q2: P2 takes P's two blocks back (8 tokens) and evicts P1's tail block, Q1 evicts all three,
    # Q2 hits 8 tokens and evicts Q1's tail.
    assert report["prefix_aware"] == {"hit_tokens": 16, "hit_rate": 16 / 48, "evictions": 5,
                                      "rows_not_fitting": 0}
    # A window of 2 rows sorts [P1 Q1] and [P2 Q2] separately: no better than file order.
    assert report_of(tmp_path, rows, "--num-blocks", 3, "--window", 2)["prefix_aware"]["hit_tokens"] == 0
    # A row longer than the whole cache cannot be replayed
    assert report_of(tmp_path, [ids(*range(1, 14))], "--num-blocks", 3)["file_order"]["rows_not_fitting"] == 1


def test_histogram_and_memory_options(tmp_path):
    rows = [ids(*range(1, n + 1)) for n in (5, 16, 17, 40, 100)]
    report = report_of(tmp_path, rows, "--kv-cache-gib", 0.5)
    assert report["num_blocks"] == 262144 // 2
    assert report["histogram"] == [{"min_tokens": 1, "max_tokens": 16, "rows": 2},
                                   {"min_tokens": 17, "max_tokens": 32, "rows": 1},
                                   {"min_tokens": 33, "max_tokens": 64, "rows": 1},
                                   {"min_tokens": 65, "max_tokens": 128, "rows": 1}]


def test_table_output_and_usage_errors(tmp_path):
    rows = [ids(*P, 1), ids(*P, 2), {"prompt": 5}]
    result = inspect(tmp_path, rows)
    assert result.exit_code == 0
    for heading in ("blocks needed", "expected prefix-cache hits", "most shared prefixes", "prompt lengths",
                    "line 3: 'prompt' must be"):
        assert heading in result.stdout, heading
    for args, message in ((["--block-size", 24], "power of two"), (["--model", "nope"], "neither a .gguf"),
                          (["--input-format", "xml"], "input-format")):
        path = tmp_path / "in.jsonl"
        result = CliRunner().invoke(app, ["inspect-cache", str(path), *map(str, args)])
        assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr
