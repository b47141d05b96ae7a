"""Output records, one per input row: plain result rows, or OpenAI batch output lines for OpenAI input.

Plain: {"id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "error",
"structured_complete", "input_fingerprint"} (+ "prompt_token_ids", "token_ids" with --include-token-ids;
+ "logprobs", "prompt_logprobs" when the row asked: per token {"token_id", "token", "logprob", "rank",
"top_logprobs": [{"token_id", "token", "logprob"}]}, the first prompt token null; + "completions": [{"index",
"text", "finish_reason", "stop_reason", "logprobs"}] when n > 1); a failed row has finish_reason "error".
`structured_complete` (null for an unconstrained row; in an OpenAI line, in the choice of a constrained one) is
false when the output was cut before its constraint was complete (max_tokens, a stop string): the text may not
parse.
OpenAI: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"} (the Batch API's output
and error lines), where body is a chat.completion or text_completion object with "usage" and OpenAI's keys only,
or {"error": {...}} for a failed row. What nanovllm adds goes into a top-level "nanovllm" object, present when
there is something to add: "choices": [{"index", "structured_complete", "token_ids"}] (a constrained row's verdict,
--include-token-ids).
Both carry "input_fingerprint", the hash of the row they answer, so `--resume` can tell a changed row.
A pooling job's records (embeddings, probabilities, scores, rewards) are pooling_records.py's.

Pass-through: the fields of a row that nanovllm does not read (the user's own data, `RowRequest.extra`) are added
to its record, after the record's own fields: on a name clash the record's own field wins. In Parquet they are
columns (`RecordLayout.passthrough`) that keep their type where JSON has one; a value JSON has no type for
(timestamp, decimal, binary) is carried as text (ISO 8601, digits, base64), as are a JSONL input's fields whose
values are not all of one JSON type (as JSON text). `RecordLayout.drop_columns` carries none.
"""
from __future__ import annotations

import base64
import datetime
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal

from nanovllm import CompletionOutput, PromptTokenizer, RequestOutput
from nanovllm_cli import pooling_records
from nanovllm_cli.choices import choices_fields
from nanovllm_cli.rows import RowError, RowRequest

PLAIN_FIELDS = ("id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "error",
                "structured_complete", "input_fingerprint")
TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")
NESTED_FIELDS = ("logprobs", "prompt_logprobs", "completions")  # plain records' fields where a row asked for them
OPENAI_FIELDS = ("id", "custom_id", "response", "error", "input_fingerprint", "nanovllm")


@dataclass(frozen=True)
class RecordLayout:
    """The shape of the records: what the writers need to know. `passthrough`: the input's own columns a Parquet
    OUTPUT gets, (name, Arrow type) (`carried_type`, `inferred_type`); `drop_columns`: carry no row field."""

    openai: bool
    include_token_ids: bool = False
    task: str | None = None  # a pooling job's task (pooling_records.py); None: generation
    embedding_size: int | None = None  # embed into Parquet: the vectors' one size (a fixed-size list column)
    passthrough: tuple[tuple[str, object], ...] = ()
    drop_columns: bool = False

    @property
    def id_key(self) -> str:
        return "custom_id" if self.openai else "id"

    @property
    def own_fields(self) -> frozenset[str]:
        """Every field a record of this layout may have of its own (a row's field of that name is not carried)."""
        if self.openai:
            return frozenset(OPENAI_FIELDS)
        if self.task is not None:
            return frozenset(name for name, _ in pooling_records.arrow_fields(self.task, None, True))
        return frozenset((*PLAIN_FIELDS, *TOKEN_ID_FIELDS, *NESTED_FIELDS))

    def arrow_schema(self):
        """Parquet columns. OpenAI's nested response and error objects are stored as JSON text."""
        import pyarrow as pa

        if self.openai:
            fields = [(name, pa.string()) for name in OPENAI_FIELDS]
        elif self.task is not None:
            fields = list(pooling_records.arrow_fields(self.task, self.embedding_size, self.include_token_ids))
        else:
            types = {"prompt_tokens": pa.int64(), "completion_tokens": pa.int64(), "cached_tokens": pa.int64(),
                     "structured_complete": pa.bool_()}
            fields = [(name, types.get(name, pa.string())) for name in PLAIN_FIELDS]
            if self.include_token_ids:
                fields += [(name, pa.list_(pa.int64())) for name in TOKEN_ID_FIELDS]
        return pa.schema(fields + list(self.passthrough))

    def parquet_row(self, record: dict) -> dict:
        """A record (as JSON gives it back) as a row of `arrow_schema`: a carried field of a text column that
        holds another JSON value is JSON text."""
        if self.openai:
            record = {k: v if v is None or isinstance(v, str) or k not in OPENAI_FIELDS else json.dumps(v, ensure_ascii=False)
                      for k, v in record.items()}
        for name, kind in self.passthrough:
            value = record.get(name)
            if str(kind) == "string" and value is not None and not isinstance(value, str):
                record[name] = json.dumps(value, ensure_ascii=False)
        return record


def carried_value(value: object) -> object:
    """A row's own value as JSON holds it: timestamps as ISO 8601 text, decimals as their digits, bytes as base64."""
    if isinstance(value, dict):
        return {str(k): carried_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [carried_value(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, Decimal):
        return str(value)
    return str(value)


def carried_type(arrow_type):
    """A Parquet input column's type in OUTPUT: itself where JSON holds its values, else text (`carried_value`)."""
    import pyarrow as pa

    t = arrow_type
    if pa.types.is_null(t) or pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
        return t
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(carried_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, carried_type(f.type)) for f in t])
    return pa.string()


def inferred_type(kinds: set[str]):
    """A JSONL input field's type in a Parquet OUTPUT, from the JSON kinds of its values ("bool", "int", "float",
    "str", "other"): one Arrow type where they agree (ints and floats: float64), else JSON text."""
    import pyarrow as pa

    if kinds == {"bool"}:
        return pa.bool_()
    if kinds == {"int"}:
        return pa.int64()
    if kinds and kinds <= {"int", "float"}:
        return pa.float64()
    return pa.string()


def json_kind(value: object) -> str:
    """What `inferred_type` counts a JSON value as (an integer outside int64 is "other")."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if -(1 << 63) <= value < 1 << 63 else "other"
    return "float" if isinstance(value, float) else "str" if isinstance(value, str) else "other"


# Characters JSON may hold raw that Python's str.splitlines (and some editors) take for line ends.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def record_line(record: dict) -> str:
    """A record as one JSONL line: text as UTF-8, except U+0085, U+2028 and U+2029, escaped, so that every
    reader (`str.splitlines` too) sees one line per record."""
    return json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS) + "\n"


def _random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class RecordBuilder:
    layout: RecordLayout
    model: str  # the name records give the model (--served-model-name, else the engine's)
    fingerprints: Mapping[str, str] = field(default_factory=dict)  # row id -> its content hash
    prompts: PromptTokenizer | None = None  # the engine's: echoed token-id prompts and prompt tokens as text

    def _token_text(self, token_id: int) -> str | None:
        tokenizer = self.prompts.tokenizer if self.prompts is not None else None
        return None if tokenizer is None else tokenizer.decode([token_id])

    def _prompt_text(self, request: RowRequest, output: RequestOutput) -> str | None:
        """The prompt as text, for echo: the row's own, or its token ids decoded."""
        if isinstance(request.payload, str):
            return request.payload
        tokenizer = self.prompts.tokenizer if self.prompts is not None else None
        return None if tokenizer is None else tokenizer.decode(output.prompt_token_ids)

    def result(self, request: RowRequest, output: RequestOutput) -> dict:
        if output.error:
            return self.error(RowError(request.id, request.where, output.error, request.endpoint, request.extra),
                              len(request.token_ids), status_code=400 if output.invalid_request else 500)
        return self._with_extra(self._result(request, output), request.extra)

    def _with_extra(self, record: dict, extra: dict) -> dict:
        """The record with the row's own fields after its own (which win a name clash)."""
        if self.layout.drop_columns or not extra:
            return record
        own = self.layout.own_fields
        return {**record, **{k: carried_value(v) for k, v in extra.items() if k not in own}}

    def _result(self, request: RowRequest, output: RequestOutput) -> dict:
        if self.layout.task is not None:
            return self._pooling_result(request, output)
        if request.choices is not None:  # scored choices (choices.py)
            return {"id": request.id, "finish_reason": None, "prompt_tokens": output.num_prompt_tokens,
                    "completion_tokens": 0, "cached_tokens": output.num_cached_tokens, "error": None,
                    "structured_complete": None, "input_fingerprint": self.fingerprints.get(request.id),
                    **choices_fields(request.choices, output)}
        completion = len(output.token_ids)
        if not self.layout.openai:
            record = {"id": request.id, "text": output.text, "finish_reason": output.finish_reason,
                      "prompt_tokens": output.num_prompt_tokens, "completion_tokens": completion,
                      "cached_tokens": output.num_cached_tokens, "error": None,
                      "structured_complete": output.structured_complete,
                      "input_fingerprint": self.fingerprints.get(request.id)}
            if self.layout.include_token_ids:
                record.update(prompt_token_ids=output.prompt_token_ids, token_ids=output.token_ids)
            k, prompt_k = request.params.logprobs, request.params.prompt_logprobs
            if output.logprobs is not None:
                record["logprobs"] = _plain_positions(output.token_ids, output.logprobs, k)
            if output.prompt_logprobs is not None:
                record["prompt_logprobs"] = _plain_positions(output.prompt_token_ids, output.prompt_logprobs, prompt_k)
            if len(output.outputs) > 1:
                record["completions"] = [
                    {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     "logprobs": None if c.logprobs is None else _plain_positions(c.token_ids, c.logprobs, k)}
                    for c in output.outputs]
            return record
        chat = request.endpoint != "completions"
        choices = [self._choice(request, output, c, chat) for c in output.outputs]
        added = [self._added(output, c) for c in output.outputs]
        completion = sum(len(c.token_ids) for c in output.outputs)
        body = {
            "id": _random_id("chatcmpl-" if chat else "cmpl-"),
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model if request.lora_request is None else request.lora_request.lora_name,
            "choices": choices,
            "usage": {"prompt_tokens": output.num_prompt_tokens, "completion_tokens": completion,
                      "total_tokens": output.num_prompt_tokens + completion,
                      "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}},
        }
        record = {"id": _random_id("batch_req_"), "custom_id": request.id,
                  "response": {"status_code": 200, "request_id": _random_id("req_"), "body": body}, "error": None,
                  "input_fingerprint": self.fingerprints.get(request.id)}
        if any(len(a) > 1 for a in added):
            record["nanovllm"] = {"choices": added}
        return record

    def _added(self, output: RequestOutput, c: CompletionOutput) -> dict:
        """What nanovllm adds to an OpenAI choice, kept out of OpenAI's body."""
        added = {"index": c.index}
        if output.structured_complete is not None:
            added["structured_complete"] = output.structured_complete
        if self.layout.include_token_ids:
            added["token_ids"] = c.token_ids
        return added

    def _pooling_result(self, request: RowRequest, output) -> dict:
        fingerprint = self.fingerprints.get(request.id)
        if self.layout.openai:
            return {"id": _random_id("batch_req_"), "custom_id": request.id,
                    "response": {"status_code": 200, "request_id": _random_id("req_"),
                                 "body": pooling_records.embeddings_body(output, self.model)},
                    "error": None, "input_fingerprint": fingerprint}
        try:
            return pooling_records.result_record(self.layout.task, request, output, fingerprint,
                                                 self.layout.embedding_size, self.layout.include_token_ids)
        except pooling_records.RecordProblem as exc:
            return self.error(RowError(request.id, request.where, str(exc), request.endpoint), output.num_prompt_tokens)

    def _choice(self, request: RowRequest, output: RequestOutput, c: CompletionOutput, chat: bool) -> dict:
        """One OpenAI choice: its message or text, and logprobs in the endpoint's exact shape."""
        choice = {"index": c.index, "logprobs": None, "finish_reason": c.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
            if c.logprobs is not None:
                choice["logprobs"] = {"content": [_chat_position(token_id, p, request.params.logprobs)
                                                  for token_id, p in zip(c.token_ids, c.logprobs)]}
        else:
            prompt_text = self._prompt_text(request, output)
            choice["text"] = (prompt_text or "") + (c.text or "") if request.echo else c.text
            if c.logprobs is not None:
                # Offsets count from the prompt's start (OpenAI's text_offset): the completion's first token is at
                # the prompt's length, echoed or not; echoed prompt tokens from 0.
                prompt = None
                if request.echo and output.prompt_logprobs is not None:
                    prompt = _completions_logprobs(list(zip(output.prompt_token_ids, output.prompt_logprobs)),
                                                   request.params.logprobs, 0, self._token_text)
                start = len(prompt_text) if prompt_text is not None else _end_offset(prompt) if prompt else 0
                logprobs = _completions_logprobs(list(zip(c.token_ids, c.logprobs)), request.params.logprobs, start,
                                                 self._token_text)
                choice["logprobs"] = logprobs if prompt is None else {k: prompt[k] + logprobs[k] for k in logprobs}
        return choice

    def error(self, error: RowError, prompt_tokens: int = 0, status_code: int = 400) -> dict:
        """400: the row is invalid; 500: the engine failed on a valid row."""
        return self._with_extra(self._error(error, prompt_tokens, status_code), error.extra)

    def _error(self, error: RowError, prompt_tokens: int, status_code: int) -> dict:
        if not self.layout.openai and self.layout.task is not None:
            return pooling_records.error_record(self.layout.task, error.id, error.message, prompt_tokens,
                                                self.fingerprints.get(error.id), self.layout.include_token_ids)
        if not self.layout.openai:
            record = {"id": error.id, "text": None, "finish_reason": "error", "prompt_tokens": prompt_tokens,
                      "completion_tokens": 0, "cached_tokens": 0, "error": error.message,
                      "structured_complete": None, "input_fingerprint": self.fingerprints.get(error.id)}
            if self.layout.include_token_ids:
                record.update(prompt_token_ids=None, token_ids=None)
            return record
        code = "invalid_request" if status_code == 400 else "server_error"
        kind = "invalid_request_error" if status_code == 400 else "server_error"
        body = {"error": {"message": error.message, "type": kind, "param": None, "code": code}}
        return {"id": _random_id("batch_req_"), "custom_id": error.id,
                "response": {"status_code": status_code, "request_id": _random_id("req_"), "body": body},
                "error": {"code": code, "message": error.message}, "input_fingerprint": self.fingerprints.get(error.id)}


def _top(position: dict, num_top: int) -> list:
    """The k most likely of a position's {token id: Logprob} (the scored token is there only when among them)."""
    return sorted(position.items(), key=lambda item: item[1].rank)[:num_top]


def _plain_position(token_id: int, position: dict, num_top: int) -> dict:
    """One position: the scored token (its logprob and rank) and its top alternatives."""
    chosen = position[token_id]
    return {"token_id": token_id, "token": chosen.decoded_token, "logprob": chosen.logprob, "rank": chosen.rank,
            "top_logprobs": [{"token_id": tid, "token": lp.decoded_token, "logprob": lp.logprob}
                             for tid, lp in _top(position, num_top)]}


def _plain_positions(token_ids: list[int], positions: list, num_top: int) -> list[dict | None]:
    return [None if p is None else _plain_position(t, p, num_top) for t, p in zip(token_ids, positions)]


def _token_bytes(token: str | None) -> list[int] | None:
    return None if token is None else list(token.encode("utf-8"))


def _chat_position(token_id: int, position: dict, num_top: int) -> dict:
    """OpenAI chat shape: {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}."""
    chosen = position[token_id]
    top = _top(position, num_top)
    return {"token": chosen.decoded_token, "logprob": chosen.logprob, "bytes": _token_bytes(chosen.decoded_token),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob, "bytes": _token_bytes(lp.decoded_token)}
                             for _, lp in top]}


def _end_offset(logprobs: dict) -> int:
    """The offset just after the last token of a completions logprobs object."""
    if not logprobs["tokens"]:
        return 0
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1] or "")


def _completions_logprobs(positions: list[tuple[int, dict | None]], num_top: int, offset: int,
                          token_text: Callable[[int], str | None]) -> dict:
    """OpenAI completions shape: parallel lists tokens, token_logprobs, top_logprobs ({token: logprob}) and
    text_offset (from `offset`, each token's text after the one before); an echoed first prompt token has its text
    and null logprobs."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, position in positions:
        if position is None:
            tokens.append(token_text(token_id))
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            chosen = position[token_id]
            tokens.append(chosen.decoded_token)
            token_logprobs.append(chosen.logprob)
            top_logprobs.append({lp.decoded_token: lp.logprob for _, lp in _top(position, num_top)})
        offsets.append(offset)
        offset += len(tokens[-1] or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
