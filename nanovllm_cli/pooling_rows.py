"""Rows of a pooling job (`run --task embed|classify|score|reward`) -> the request's input and PoolingParams, or
a RowProblem naming the field.

Plain rows: {"id", "text" or "prompt": str} | {"id", "messages": [...]} (the model's chat template) |
{"id", "prompt_token_ids": [int, ...]} for embed, classify and reward; a score row is a pair {"id", "text_1",
"text_2"} or a query with its documents {"id", "query", "documents": [str, ...]} (one record with each
document's score). Pooling fields, at the top level or in "pooling_params", override the command-line defaults:
dimensions and normalize (embed), activation (classify, score). OpenAI batch lines of `/v1/embeddings`:
{"custom_id", "method": "POST", "url": "/v1/embeddings", "body": {"input": str | [int, ...], "model",
"dimensions", "encoding_format": "float", "user"}}. A generation field (max_tokens, temperature, ...) in a
pooling row is refused by name, as is anything of an embeddings body nanovllm does not implement."""
from __future__ import annotations

from nanovllm import PoolingParams
from nanovllm_cli.rows import SAMPLING_FIELDS, RowParser, RowProblem, RowRequest, _checked_payload, _type_name, row_overrides

POOLING_FIELDS = ("dimensions", "normalize", "activation")
INPUT_KEYS = {"text": "prompt", "prompt": "prompt", "messages": "messages", "prompt_token_ids": "token_ids"}
SCORE_KINDS = {"pair": ("text_1", "text_2"), "documents": ("query", "documents")}
POOLING_INPUT_COLUMNS = ("text", "text_1", "query")  # a Parquet input of a pooling job has one of them (or a prompt's)
EMBEDDINGS_URL = "/v1/embeddings"
EMBEDDINGS_BODY_KEYS = {"input", "model", "dimensions", "encoding_format", "user"}


class PoolingRowParser(RowParser):
    """RowParser of a `task` job: rows as above, `pooling_defaults` (PoolingParams fields) overridden by a row's."""

    # What a pooling row may hold (generation fields too, which _plain_fields refuses by name for this job).
    plain_row_keys = frozenset({"id", *INPUT_KEYS, *(key for keys in SCORE_KINDS.values() for key in keys),
                                *POOLING_FIELDS, "pooling_params", "sampling_params", *SAMPLING_FIELDS})

    def __init__(self, base_seed: int, label: str, task: str, pooling_defaults: dict, source: str | None = None):
        super().__init__({}, base_seed, label, source)
        self.task = task
        self.pooling_defaults = pooling_defaults

    def _endpoint(self, row: dict) -> str:
        return "embeddings"

    def _request(self, row_id: str, where: str, row: dict, openai: bool, endpoint: str | None,
                 passed: dict) -> RowRequest:
        return RowRequest(row_id, where, *pooling_request(row, openai, self.task, self.pooling_defaults), endpoint,
                          extra=passed)


def pooling_request(row: dict, openai: bool, task: str, defaults: dict) -> tuple[str, object, PoolingParams]:
    """(kind, payload, params) of a row of a `task` job. Kinds: "prompt", "messages", "token_ids" (one input),
    "pair" and "documents" (score rows; payload (query, [documents]))."""
    kind, payload, overrides = _openai_fields(row, task) if openai else _plain_fields(row, task)
    values = {**defaults, **overrides}
    try:
        params = PoolingParams(task=task, **values)
    except (TypeError, ValueError) as exc:
        raise RowProblem(f"invalid pooling parameters: {str(exc).removeprefix('PoolingParams.')}") from None
    return kind, payload, params


def _plain_fields(row: dict, task: str) -> tuple[str, object, dict]:
    generation = sorted(key for key in SAMPLING_FIELDS if row.get(key) is not None)
    if generation or row.get("sampling_params") is not None:
        names = ", ".join(generation or ["sampling_params"])
        raise RowProblem(f"{names}: generation fields do not apply to --task {task} rows (theirs: "
                         f"{', '.join(POOLING_FIELDS)})")
    overrides = row_overrides(row, POOLING_FIELDS, "pooling_params", lambda unknown: (
        f"unknown pooling parameter(s) {', '.join(unknown)} (known: {', '.join(POOLING_FIELDS)})"))
    inputs = [key for key in INPUT_KEYS if key in row]
    pairs = [kind for kind, keys in SCORE_KINDS.items() if any(key in row for key in keys)]
    if task == "score":
        if len(pairs) != 1 or inputs:
            raise RowProblem("a score row is a pair: 'text_1' and 'text_2', or 'query' and 'documents' (a list)")
        kind = pairs[0]
        first, second = SCORE_KINDS[kind]
        if first not in row or second not in row:
            raise RowProblem(f"a score row with '{first}' or '{second}' needs both")
        query = _checked_payload("prompt", row[first], first)
        if kind == "pair":
            return kind, (query, [_checked_payload("prompt", row[second], second)]), overrides
        documents = row[second]
        if not isinstance(documents, list) or not documents:
            raise RowProblem(f"'documents' must be a non-empty array of strings, not {_type_name(documents)}")
        return kind, (query, [_checked_payload("prompt", d, f"documents[{i}]") for i, d in enumerate(documents)]), \
            overrides
    if pairs:
        raise RowProblem(f"'{SCORE_KINDS[pairs[0]][0]}' / '{SCORE_KINDS[pairs[0]][1]}' make a score row: run "
                         "--task score")
    if len(inputs) != 1:
        which = "none" if not inputs else "more than one"
        raise RowProblem(f"the row has {which} of {', '.join(repr(k) for k in INPUT_KEYS)}")
    key = inputs[0]
    kind = INPUT_KEYS[key]
    return kind, _checked_payload(kind, row[key], key), overrides


def _openai_fields(row: dict, task: str) -> tuple[str, object, dict]:
    if row.get("url") != EMBEDDINGS_URL:
        raise RowProblem(f"unsupported url {row.get('url')!r} for --task {task}: OpenAI batch lines of a pooling job "
                         f"are {EMBEDDINGS_URL}")
    if task != "embed":
        raise RowProblem(f"{EMBEDDINGS_URL} lines are embeddings: run --task embed")
    if row.get("method", "POST") != "POST":
        raise RowProblem(f"unsupported method {row.get('method')!r} (only POST)")
    body = row.get("body")
    if not isinstance(body, dict):
        raise RowProblem(f"'body' must be an object, not {_type_name(body)}")
    unknown = sorted(set(body) - EMBEDDINGS_BODY_KEYS)
    if unknown:
        raise RowProblem(f"unsupported field(s) {', '.join('body.' + k for k in unknown)} for {EMBEDDINGS_URL}")
    if body.get("encoding_format", "float") != "float":
        raise RowProblem(f"body.encoding_format {body['encoding_format']!r} is not supported: use \"float\"")
    if "input" not in body:
        raise RowProblem(f"a {EMBEDDINGS_URL} body needs 'input'")
    value = body["input"]
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # one input given as a list of one
    if isinstance(value, list) and value and not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RowProblem("body.input holds several inputs: put each in a line of its own")
    kind = "token_ids" if isinstance(value, list) else "prompt"
    overrides = {"dimensions": body["dimensions"]} if body.get("dimensions") is not None else {}
    return kind, _checked_payload(kind, value, "body.input"), overrides
