"""Input rows -> requests or error records, and the admission order of a window (no model needed)."""
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanovllm_cli.admission import admission_groups
from nanovllm_cli.preflight import scan_input
from nanovllm_cli.readers import InvalidJson, detect_format, iter_rows
from nanovllm_cli.rows import RowError, RowParser, RowRequest, derive_seed

DEFAULTS = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "stop": [],
            "ignore_eos": False}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def parse(row, number=7, label="line"):
    return RowParser(DEFAULTS, 0, label).parse(number, row)


@pytest.mark.parametrize("row, kind, payload, endpoint", [
    ({"id": "a", "prompt": "Hello"}, "prompt", "Hello", None),
    ({"id": "a", "messages": CHAT}, "messages", CHAT, None),
    ({"id": "a", "prompt_token_ids": [5, 6]}, "token_ids", [5, 6], None),
    ({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": CHAT}},
     "messages", CHAT, "chat"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "Hello"}}, "prompt", "Hello", "completions"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [5, 6]}}, "token_ids", [5, 6], "completions"),
    ({"custom_id": "a", "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "H"},
                                                                          {"type": "text", "text": "i"}]}]}},
     "messages", [{"role": "user", "content": "Hi"}], "chat"),
])
def test_row_forms(row, kind, payload, endpoint):
    request = parse(row)
    assert isinstance(request, RowRequest)
    assert (request.id, request.kind, request.payload, request.endpoint) == ("a", kind, payload, endpoint)
    assert request.params.max_tokens == DEFAULTS["max_tokens"] and request.where == "line 7"


def test_row_without_id_gets_its_number_and_a_seed_derived_from_it():
    request = parse({"prompt": "x"}, number=12, label="row")
    assert request.id == "12" and request.where == "row 12"
    assert request.params.seed == derive_seed(0, "12") != derive_seed(0, "13") != derive_seed(1, "12")
    assert parse({"id": 4, "prompt": "x", "seed": 99}).params.seed == 99


def test_sampling_overrides():
    plain = parse({"prompt": "x", "max_tokens": 3, "temperature": 0.5, "stop": "END",
                   "sampling_params": {"max_tokens": 5, "top_k": 4, "stop_token_ids": [9], "ignore_eos": True}})
    assert (plain.params.max_tokens, plain.params.temperature, plain.params.top_k) == (5, 0.5, 4)
    assert plain.params.stop == ["END"] and plain.params.stop_token_ids == [9] and plain.params.ignore_eos
    openai = parse({"custom_id": "c", "body": {"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 6,
                                               "top_p": 0.5, "seed": 1, "temperature": None, "model": "m"}})
    assert (openai.params.max_tokens, openai.params.top_p, openai.params.seed) == (6, 0.5, 1)
    assert openai.params.temperature == DEFAULTS["temperature"]  # null = not given


@pytest.mark.parametrize("row, row_id, problem", [
    (InvalidJson("invalid JSON: Expecting value"), "7", "invalid JSON"),
    ([1, 2], "7", "must be a JSON object, not an array"),
    ("text", "7", "must be a JSON object, not a string"),
    ({"id": "a"}, "a", "none of 'prompt', 'messages', 'prompt_token_ids'"),
    ({"id": "a", "prompt": "x", "messages": CHAT}, "a", "more than one of"),
    ({"id": "a", "prompt": 5}, "a", "'prompt' must be a non-empty string, not an integer"),
    ({"id": "a", "prompt": ""}, "a", "'prompt' is an empty string"),
    ({"id": "a", "messages": "hi"}, "a", "'messages' must be a non-empty array"),
    ({"id": "a", "messages": [{"role": "user"}]}, "a", "'messages'[0] must be an object with a string 'role'"),
    ({"id": "a", "prompt_token_ids": [1, "2"]}, "a", "array of integer token ids"),
    ({"id": "a", "prompt_token_ids": []}, "a", "array of integer token ids"),
    ({"id": True, "prompt": "x"}, "7", "the id must be a string or an integer, not a boolean"),
    ({"id": "", "prompt": "x"}, "7", "empty string"),
    ({"id": "a", "prompt": "x", "temperature": -1}, "a", "invalid sampling parameters: temperature=-1"),
    ({"id": "a", "prompt": "x", "max_tokens": "9"}, "a", "invalid sampling parameters"),
    ({"id": "a", "prompt": "x", "temperature": True}, "a", "temperature=True: must be a finite number"),
    ({"id": "a", "prompt": "x", "ignore_eos": "yes"}, "a", "ignore_eos='yes': must be True or False"),
    ({"id": "a", "prompt": "x", "stop": 5}, "a", "invalid sampling parameters: stop=5: must be a list"),
    ({"id": "a", "prompt": "x", "seed": 2**63}, "a", "seed=9223372036854775808: must be an integer in"),
    ({"id": "a", "prompt": "x", "top_k": -2**63 - 1}, "a", "top_k="),
    ({"id": "a", "prompt": "x", "max_tokens": 2**63}, "a", "max_tokens="),
    ({"id": "a", "prompt": "x", "stop_token_ids": [2**63]}, "a", "stop_token_ids="),
    ({"id": "a", "prompt": "x", "temperature": float("nan")}, "a", "temperature=nan"),
    ({"id": "a", "prompt": "x", "min_p": float("-inf")}, "a", "min_p=-inf"),
    ({"id": "a", "prompt": "x", "temperature": 1e39}, "a", "temperature=1e+39"),
    ({"id": "a", "prompt": "\ud800"}, "a", "not valid Unicode"),
    ({"id": "\udc00", "prompt": "x"}, "7", "the id is not valid Unicode"),
    ({"id": "a", "prompt": "x", "sampling_params": {"beam": 2}}, "a", "unknown sampling parameter 'beam'"),
    ({"id": "a", "prompt": "x", "sampling_params": 3}, "a", "'sampling_params' must be an object"),
    ({"custom_id": "a", "url": "/v1/embeddings", "body": {}}, "a", "unsupported url '/v1/embeddings'"),
    ({"custom_id": "a", "method": "GET", "body": {"messages": CHAT}}, "a", "unsupported method 'GET'"),
    ({"custom_id": "a", "body": "x"}, "a", "'body' must be an object, not a string"),
    ({"custom_id": "a", "body": {"prompt": "x"}}, "a", "a chat request body needs 'messages'"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": ["x", "y"]}}, "a", "body.prompt"),
    ({"custom_id": "a", "body": {"messages": CHAT, "tools": []}}, "a", "unsupported field 'body.tools': tool calling"),
    ({"custom_id": ["a"], "body": {"messages": CHAT}}, "7", "the id must be a string or an integer"),
])
def test_bad_rows_name_the_row_and_the_problem(row, row_id, problem):
    error = parse(row)
    assert isinstance(error, RowError)
    assert error.id == row_id
    assert error.message.startswith("line 7: ") and problem in error.message
    openai = isinstance(row, dict) and "body" in row
    assert error.endpoint == (None if not openai else "completions" if row.get("url") == "/v1/completions" else "chat")


def test_jsonl_reader_skips_blank_lines_but_keeps_line_numbers(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n  \n{oops\n[1]\n{"prompt": "b"}')  # no newline at the end
    rows = list(iter_rows(path, "jsonl"))
    assert [n for n, _ in rows] == [1, 4, 5, 6]
    assert isinstance(rows[1][1], InvalidJson) and rows[2][1] == [1] and rows[3][1] == {"prompt": "b"}
    assert scan_input(path, "jsonl").rows == 4


def test_parquet_reader_drops_nulls_of_absent_fields(tmp_path):
    rows = [{"id": "a", "prompt": "x", "messages": None}, {"id": None, "prompt": None, "messages": CHAT}]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert list(iter_rows(path, "parquet")) == [(1, {"id": "a", "prompt": "x"}), (2, {"messages": CHAT})]
    assert scan_input(path, "parquet").rows == 2
    assert parse(dict(iter_rows(path, "parquet"))[2], number=2, label="row").id == "2"


def test_detect_format(tmp_path):
    assert detect_format(tmp_path / "a.jsonl", None) == "jsonl"
    assert detect_format(tmp_path / "a.PARQUET", None) == "parquet"
    assert detect_format(tmp_path / "a.csv", None) == "csv"
    assert detect_format(tmp_path / "a.txt", "jsonl") == "jsonl"
    for path, override in ((tmp_path / "a.txt", None), (tmp_path / "a.jsonl", "xml")):
        with pytest.raises(ValueError, match="input-format"):
            detect_format(path, override)


def _request(row_id, token_ids):
    request = parse({"id": row_id, "prompt_token_ids": token_ids})
    request.token_ids = token_ids
    return request


def test_prefix_aware_groups_rows_sharing_a_full_block():
    block = 4
    rows = [_request("p1", [1, 2, 3, 4, 9]), _request("q1", [5, 6, 7, 8, 1]), _request("p2", [1, 2, 3, 4, 7, 7]),
            _request("short", [1, 2, 3]), _request("q2", [5, 6, 7, 8, 2]), _request("p3", [1, 2, 3, 5, 5])]
    groups = admission_groups(rows, True, block)
    assert [[r.id for r in g.requests] for g in groups] == [["short"], ["p2", "p1"], ["p3"], ["q1", "q2"]]
    in_file_order = admission_groups(rows, False, block)
    assert [[r.id for r in g.requests] for g in in_file_order] == [[r.id] for r in rows]


def test_samples_hold_the_same_rows_in_each_form():
    samples = Path(__file__).resolve().parent.parent / "samples"
    jsonl = [json.loads(line) for line in (samples / "prompts.jsonl").read_text().splitlines()]
    openai = [parse(row) for _, row in iter_rows(samples / "openai_batch.jsonl", "jsonl")]
    assert [r.id for r in openai] == [row["id"] for row in jsonl]
    assert all(isinstance(r, RowRequest) for r in openai)
    assert [r.payload for r in openai] == [row.get("prompt", row.get("messages")) for row in jsonl]
    parquet = [parse(row) for _, row in iter_rows(samples / "prompts.parquet", "parquet")]
    assert [(r.id, r.kind, r.payload) for r in parquet] == [
        (r.id, r.kind, r.payload) for r in (parse(row) for row in jsonl)]
