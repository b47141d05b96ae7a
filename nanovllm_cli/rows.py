"""One input row -> a request to run, or an error naming the row and the problem. No engine needed.

Row forms: {"id", "prompt": str}, {"id", "messages": [{"role", "content"}, ...]}, {"id", "prompt_token_ids":
[int, ...]}, and OpenAI batch request lines {"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}. Sampling fields of the row (top level or in "sampling_params"; in the body
for OpenAI lines) override the command-line defaults. A row constrains its output with `structured_outputs`
(vLLM's fields: json, json_object, regex, choice, grammar), an OpenAI line with `response_format`. A row runs
with a LoRA adapter of --lora-modules named by its `lora` field, an OpenAI line by its body's `model`
(lora_modules.py).
A field the row form does not read is refused by name when it is a mistake (`row_fields`), else carried through to
the row's record as the user's own data (`extra`). A row brings no code: the chat template is the model's or the
command line's, and `chat_template_kwargs` only hands it values.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import xxhash

from nanovllm import LoRARequest, PoolingParams, SamplingParams, from_response_format
from nanovllm_cli.lora_modules import NO_MODULES, LoRAModules
from nanovllm_cli.readers import InvalidJson
from nanovllm_cli.row_fields import meant_field, openai_body_problem, plain_field_problem, quoted_name

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed",
                   "ignore_eos", "structured_outputs", "n", "best_of", "logprobs", "prompt_logprobs",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logit_bias",
                   "allowed_token_ids", "bad_words", "include_stop_str_in_output", "skip_special_tokens")
PROMPT_KEYS = {"prompt": "prompt", "messages": "messages", "prompt_token_ids": "token_ids"}
OPENAI_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# OpenAI body key -> SamplingParams field; max_completion_tokens comes after max_tokens, so it wins.
OPENAI_SAMPLING_KEYS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
                        "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "stop": "stop", "stop_token_ids": "stop_token_ids", "seed": "seed",
                        "ignore_eos": "ignore_eos", "n": "n", "presence_penalty": "presence_penalty",
                        "frequency_penalty": "frequency_penalty", "logit_bias": "logit_bias",
                        "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens"}
# Every other body key a line may carry, per endpoint; anything else is rejected by name (never ignored).
OPENAI_OTHER_KEYS = {"chat": {"messages", "logprobs", "top_logprobs", "chat_template_kwargs", "response_format"},
                     "completions": {"prompt", "logprobs", "echo", "best_of", "response_format"}}
# OpenAI's defaults where they differ from the command line's: an OpenAI line replays with OpenAI's semantics (n: 2
# gives two samples) unless the user set the field on the command line.
OPENAI_DEFAULTS = {"temperature": 1.0}
PLAIN_ROW_KEYS = frozenset({"id", *PROMPT_KEYS, "sampling_params", "chat_template_kwargs", "lora", "choices",
                            *SAMPLING_FIELDS})
OPENAI_ROW_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass
class RowRequest:
    """A row that can go to the engine once tokenized."""

    id: str
    where: str  # "line 7" (JSONL) or "row 7" (Parquet), for error messages
    kind: str  # "prompt" | "messages" | "token_ids"; a score row's "pair" | "documents" (pooling_rows.py)
    payload: str | list | tuple
    params: SamplingParams | PoolingParams  # PoolingParams: a row of a pooling job (pooling_rows.py)
    endpoint: str | None = None  # OpenAI lines: "chat" | "completions" | "embeddings"
    echo: bool = False  # /v1/completions: the prompt (and its logprobs) leads the completion
    chat_template_kwargs: dict | None = None
    choices: list[str] | None = None  # continuations to score instead of generating (choices.py)
    token_ids: list[int] = field(default_factory=list)  # filled by tokenize_row
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)
    extra: dict = field(default_factory=dict)  # the row's own fields nanovllm does not read, for its record


@dataclass
class RowError:
    """A row that cannot run: it gets an error record instead of a result."""

    id: str
    where: str
    problem: str
    endpoint: str | None = None
    extra: dict = field(default_factory=dict)  # as RowRequest.extra

    @property
    def message(self) -> str:
        return f"{self.where}: {self.problem}"


class RowProblem(ValueError):
    pass


def is_openai_row(value: object) -> bool:
    return isinstance(value, dict) and ("custom_id" in value or "body" in value)


# Fields of a row (plain, or a pooling job's: pooling_rows.py) or of an OpenAI body that hold text to tokenize.
TEXT_FIELDS = ("prompt", "messages", "choices", "text", "text_1", "text_2", "query", "documents", "input")


def needs_tokenizer(row: object) -> bool:
    """Whether a row gives text (not only token ids): it cannot run on a model without a tokenizer."""
    if not isinstance(row, dict):
        return False
    fields = row.get("body") if is_openai_row(row) else row
    if not isinstance(fields, dict):
        return False
    for name in TEXT_FIELDS:
        value = fields.get(name)
        if isinstance(value, str) or (isinstance(value, list) and value and not all(
                isinstance(v, int) or (isinstance(v, list) and all(isinstance(t, int) for t in v)) for v in value)):
            return True
    return False


def derive_seed(base_seed: int, row_id: str) -> int:
    """A row without a seed samples with one derived from (--seed, id): the same whatever the order or resume."""
    return xxhash.xxh64_intdigest(f"{base_seed}:{row_id}".encode()) & ((1 << 63) - 1)


def _type_name(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
             int: "an integer", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _row_id(value: object, default: str) -> str:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowProblem(f"the id must be a string or an integer, not {_type_name(value)}")
    if value == "":
        raise RowProblem("the id is an empty string")
    if _has_lone_surrogate(value):
        raise RowProblem("the id is not valid Unicode")
    return str(value)


def row_id(number: int, row: object) -> str:
    """The id a row's records carry: its "id" ("custom_id" for OpenAI lines), else its line or row number."""
    if not isinstance(row, dict):
        return str(number)
    try:
        return _row_id(row.get("custom_id" if is_openai_row(row) else "id"), str(number))
    except RowProblem:
        return str(number)


def row_fingerprint(row: object) -> str:
    """A hash of a row's content (keys in any order): `--resume` reruns rows whose input changed. Values JSON has
    no type for (a Parquet timestamp, binary or decimal column) count by their repr."""
    text = row.message if isinstance(row, InvalidJson) else json.dumps(row, sort_keys=True, default=repr)
    return xxhash.xxh64_hexdigest(text.encode("utf-8", "surrogatepass"))


def _has_lone_surrogate(value: object) -> bool:
    """JSON can spell text that is not Unicode ("\\ud800"): no tokenizer or output file can take it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


def _message_text(content: object) -> object:
    """OpenAI content parts [{"type": "text", "text": ...}, ...] -> one string; anything else unchanged."""
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return content


def _checked_payload(kind: str, payload: object, name: str) -> str | list:
    if kind == "prompt":
        if payload == "":
            raise RowProblem(f"'{name}' is an empty string")
        if not isinstance(payload, str):
            raise RowProblem(f"'{name}' must be a non-empty string, not {_type_name(payload)}")
        return payload
    if kind == "messages":
        if not isinstance(payload, list) or not payload:
            raise RowProblem(f"'{name}' must be a non-empty array of {{role, content}} objects, "
                             f"not {_type_name(payload)}")
        messages = []
        for i, message in enumerate(payload):
            if isinstance(message, dict):
                message = {**message, "content": _message_text(message.get("content"))}
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise RowProblem(f"'{name}'[{i}] must be an object with a string 'role' and a text 'content'")
            messages.append(message)
        return messages
    if not isinstance(payload, list) or not payload or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in payload):
        raise RowProblem(f"'{name}' must be a non-empty array of integer token ids")
    return payload


def row_overrides(row: dict, fields, nested_name: str, unknown_problem) -> dict:
    """The row's `fields` given at its top level or in its `nested_name` object (which wins), None values left
    out; RowProblem for a nested object that is not one, or that names fields not among `fields`
    (`unknown_problem(sorted names)` says why)."""
    overrides = {k: row[k] for k in fields if row.get(k) is not None}
    nested = row.get(nested_name)
    if nested is not None:
        if not isinstance(nested, dict):
            raise RowProblem(f"'{nested_name}' must be an object, not {_type_name(nested)}")
        unknown = sorted(set(nested) - set(fields))
        if unknown:
            raise RowProblem(unknown_problem(unknown))
        overrides.update({k: v for k, v in nested.items() if v is not None})
    return overrides


def _plain_fields(row: dict) -> tuple[str, object, dict, dict]:
    present = [key for key in PROMPT_KEYS if key in row]
    if len(present) != 1:
        which = "none" if not present else "more than one"
        raise RowProblem(f"the row has {which} of 'prompt', 'messages', 'prompt_token_ids'")
    key = present[0]
    kind = PROMPT_KEYS[key]
    overrides = row_overrides(row, SAMPLING_FIELDS, "sampling_params",
                              lambda unknown: "; ".join(_sampling_params_problem(name) for name in unknown))
    if kind != "messages" and row.get("chat_template_kwargs") is not None:
        raise RowProblem("'chat_template_kwargs' applies to a 'messages' row only")
    template_kwargs = _template_kwargs(row)  # first: a row that brings a template is refused for that
    return kind, _checked_payload(kind, row[key], key), overrides, template_kwargs


def _checked_choices(choices: object, overrides: dict) -> list[str]:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise RowProblem(f"'choices' must be a non-empty array of non-empty strings, not {_type_name(choices)}")
    if overrides:
        raise RowProblem(f"{', '.join(sorted(overrides))}: sampling fields do not apply to a row with 'choices' "
                         "(its choices are scored, not generated)")
    return choices


def _sampling_params_problem(name: str) -> str:
    problem = plain_field_problem(name, set(SAMPLING_FIELDS))
    if problem is not None:
        return "sampling_params: " + problem
    return f"unknown sampling parameter {quoted_name(name)} (known: {', '.join(SAMPLING_FIELDS)})"


def _template_kwargs(container: dict, place: str = "") -> dict:
    kwargs = container.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RowProblem(f"'{place}chat_template_kwargs' must be an object, not {_type_name(kwargs)}")
    if "chat_template" in kwargs:
        raise RowProblem(f"'{place}chat_template_kwargs.chat_template': a row cannot bring a chat template; it is the "
                         "model's, or the file given with --chat-template")
    return {"chat_template_kwargs": kwargs}


def own_fields(row: object, plain_row_keys: frozenset[str] = PLAIN_ROW_KEYS) -> dict:
    """The fields of a row that are the user's own data, carried to its record ({} for a row that is no object)."""
    return _unread_fields(row, is_openai_row(row), plain_row_keys)[0] if isinstance(row, dict) else {}


def _unread_fields(row: dict, openai: bool, plain_row_keys: frozenset[str]) -> tuple[dict, list[str]]:
    """The fields of the row that its form does not read (`plain_row_keys`: the plain rows' fields the parser
    reads): the user's own (carried to its record), and why the others are refused (a misspelling, or another
    tool's decoding field)."""
    known = OPENAI_ROW_KEYS if openai else plain_row_keys
    own, problems = {}, []
    for key, value in row.items():
        if key in known:
            continue
        if openai:
            meant = meant_field(key, OPENAI_ROW_KEYS)
            problem = meant and f"unknown field '{key}' (did you mean '{meant}'?)"
        else:
            problem = plain_field_problem(key, plain_row_keys)
        if problem:
            problems.append(problem)
        else:
            own[key] = value
    return own, problems


def _openai_logprobs(endpoint: str, body: dict) -> dict:
    """OpenAI's logprobs fields -> SamplingParams fields (and echo)."""
    logprobs, extra = body.get("logprobs"), {}
    if endpoint == "chat":
        top = body.get("top_logprobs")
        if logprobs not in (None, True, False):
            raise RowProblem(f"body.logprobs must be true or false for chat completions, not {_type_name(logprobs)}")
        if top is not None and not logprobs:
            raise RowProblem("body.top_logprobs needs body.logprobs = true")
        if logprobs:
            extra["logprobs"] = 0 if top is None else top
        return extra
    if logprobs is not None:
        if isinstance(logprobs, bool):
            raise RowProblem("body.logprobs must be an integer for completions, not a boolean")
        extra["logprobs"] = logprobs
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise RowProblem(f"body.echo must be true or false, not {_type_name(echo)}")
    if echo:
        extra["echo"] = True
        if logprobs is not None:
            extra["prompt_logprobs"] = logprobs
    if body.get("best_of") is not None:
        extra["best_of"] = body["best_of"]
    return extra


def _openai_endpoint(row: dict) -> str | None:
    url = row.get("url", "/v1/chat/completions")
    return OPENAI_ENDPOINTS.get(url) if isinstance(url, str) else None


def _openai_fields(row: dict) -> tuple[str, object, dict, dict]:
    endpoint = _openai_endpoint(row)
    if endpoint is None:
        raise RowProblem(f"unsupported url {row.get('url')!r} (use {' or '.join(OPENAI_ENDPOINTS)})")
    if row.get("method", "POST") != "POST":
        raise RowProblem(f"unsupported method {row.get('method')!r} (only POST)")
    body = row.get("body")
    if not isinstance(body, dict):
        raise RowProblem(f"'body' must be an object, not {_type_name(body)}")
    key = "messages" if endpoint == "chat" else "prompt"
    if key not in body:
        raise RowProblem(f"a {endpoint} request body needs '{key}'")
    known = set(OPENAI_SAMPLING_KEYS) | OPENAI_OTHER_KEYS[endpoint]
    problems = [openai_body_problem(k, body[k], known, endpoint == "chat") for k in body if k not in known]
    if any(problems):
        raise RowProblem("; ".join(p for p in problems if p))
    extra = _template_kwargs(body, "body.") if endpoint == "chat" else {}  # first, as for a plain row
    prompt = body[key] if endpoint == "chat" else _single_prompt(body[key])
    kind = "messages" if endpoint == "chat" else "token_ids" if isinstance(prompt, list) else "prompt"
    overrides = {name: body[key_] for key_, name in OPENAI_SAMPLING_KEYS.items() if body.get(key_) is not None}
    if body.get("response_format") is not None:
        try:
            overrides["structured_outputs"] = from_response_format(body["response_format"])
        except ValueError as exc:
            raise RowProblem(str(exc)) from None
    overrides.update(_openai_logprobs(endpoint, body))
    if "echo" in overrides:
        extra["echo"] = overrides.pop("echo")
    return kind, _checked_payload(kind, prompt, f"body.{key}"), overrides, extra


def _single_prompt(prompt: object) -> object:
    """/v1/completions' `prompt`: a string, token ids, or an array of one of either (OpenAI's forms). Several
    prompts in one line are refused: OpenAI answers them as one response of len(prompt) x n choices, which would
    give several prompts one record, one resume entry and one error between them."""
    if not isinstance(prompt, list) or not prompt or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt  # a string or token ids (_checked_payload says what else is wrong)
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if len(prompt) == 1:
            return prompt[0]
        raise RowProblem(f"body.prompt holds {len(prompt)} prompts: nanovllm answers one prompt per line (OpenAI would "
                         "answer them together, as choices of one response); put each prompt on a line of its own, with "
                         "its own custom_id")
    raise RowProblem("body.prompt must be a string, an array of token ids, or an array of one of either")


class RowParser:
    """Parses rows against the command-line sampling defaults. `source` names the file of the rows where an input
    has several: it leads each row's place ("a.jsonl line 7") and the id of a row without one ("a.jsonl:7").
    A pooling job's rows: pooling_rows.PoolingRowParser."""

    plain_row_keys = PLAIN_ROW_KEYS  # the fields of a plain row this parser reads

    def __init__(self, sampling_defaults: dict, base_seed: int, label: str, source: str | None = None,
                 lora: LoRAModules | None = None):
        # `sampling_defaults`: the sampling fields the user gave (the command line's). A plain row is greedy
        # unless they say otherwise; an OpenAI line takes OpenAI's default for a field they do not give.
        self.defaults = {"temperature": 0.0, **sampling_defaults}
        self.openai_defaults = {k: v for k, v in OPENAI_DEFAULTS.items() if k not in sampling_defaults}
        self.lora = lora  # the job's --lora-modules (None: none, and an OpenAI line's model is not looked at)
        self.base_seed = base_seed
        self.label = f"{source} {label}" if source else label  # "line" or "row"
        self.id_prefix = f"{source}:" if source else ""

    def parse(self, number: int, row: object) -> RowRequest | RowError:
        where = f"{self.label} {number}"
        default_id = f"{self.id_prefix}{number}"
        if isinstance(row, InvalidJson):
            return RowError(default_id, where, row.message)
        if not isinstance(row, dict):
            return RowError(default_id, where, f"a row must be a JSON object, not {_type_name(row)}")
        openai = is_openai_row(row)
        endpoint = self._endpoint(row) if openai else None
        try:
            row_id = _row_id(row.get("custom_id" if openai else "id"), default_id)
        except RowProblem as exc:
            return RowError(default_id, where, str(exc), endpoint)
        if _has_lone_surrogate(row):
            return RowError(row_id, where, "the row holds text that is not valid Unicode (a lone surrogate "
                            "escape such as \\ud800)", endpoint)
        passed, problems = _unread_fields(row, openai, self.plain_row_keys)
        if problems:
            return RowError(row_id, where, "; ".join(problems), endpoint, passed)
        try:
            return self._request(row_id, where, row, openai, endpoint, passed)
        except RowProblem as exc:
            return RowError(row_id, where, str(exc), endpoint, passed)

    def _endpoint(self, row: dict) -> str:
        """The endpoint an OpenAI line asks (records answer in its shape, errors included)."""
        return _openai_endpoint(row) or "chat"

    def _request(self, row_id: str, where: str, row: dict, openai: bool, endpoint: str | None,
                 passed: dict) -> RowRequest:
        """The request of a row whose id is known, carrying `passed` (its own fields) to its record; raises
        RowProblem."""
        kind, payload, overrides, extra = _openai_fields(row) if openai else _plain_fields(row)
        if not openai and row.get("choices") is not None:  # scored, not generated (choices.py)
            extra["choices"] = _checked_choices(row["choices"], overrides)
        params = self._params({**self.openai_defaults, **overrides} if openai else overrides, row_id)
        return RowRequest(row_id, where, kind, payload, params, endpoint, **extra,
                          lora_request=self._lora_request(row, openai), extra=passed)

    def _lora_request(self, row: dict, openai: bool) -> LoRARequest | None:
        try:
            if openai:
                return self.lora.for_model(row["body"].get("model")) if self.lora else None
            return (self.lora or NO_MODULES).for_row(row.get("lora"))
        except ValueError as exc:
            raise RowProblem(str(exc)) from None

    def _params(self, overrides: dict, row_id: str) -> SamplingParams:
        values = {**self.defaults, **overrides}
        bias = values.get("logit_bias")
        if isinstance(bias, dict):  # JSON object keys are strings
            try:
                values["logit_bias"] = {int(k): v for k, v in bias.items()}
            except ValueError:
                raise RowProblem("invalid sampling parameters: logit_bias keys must be token ids") from None
        try:
            params = SamplingParams(**values)
        except (TypeError, ValueError) as exc:
            raise RowProblem(f"invalid sampling parameters: {str(exc).removeprefix('SamplingParams.')}") from None
        if params.seed is None:
            params.seed = derive_seed(self.base_seed, row_id)
        return params
