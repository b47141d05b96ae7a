"""Which fields a row may carry besides those `rows` reads: a field nanovllm does not read is either a mistake,
refused by name (a misspelling of a field it reads, or a field another tool decodes with that nanovllm does not
implement on that row form), or the user's own data, carried through to the row's record (a pass-through column).

An OpenAI line's body is OpenAI's: besides the fields nanovllm reads, it may carry the ones OpenAI documents that do
not change the output (`metadata`, `user`, `store`, `stream: false`, ...); any other body field is refused by name.
"""
from __future__ import annotations

import difflib
from functools import lru_cache

# A field is taken for a misspelling of a known one at this similarity (difflib's ratio, 0..1) or above:
# "temprature" / "max_token" are, a user's "topic" (0.8 to "top_p") or "ids" is not.
MISSPELLING_CUTOFF = 0.85

_BEAMS, _TOOLS = "beam search is not implemented", "tool calling is not implemented"
_FORMAT = "use 'body.response_format'"

# Decoding fields of other tools (HF generate, SGLang, TGI, llama.cpp, older vLLM, OpenAI) that a plain row does not
# implement: the field that does it here, or why there is none.
PLAIN_FIELD_INSTEAD = {
    "max_new_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "n_predict": "max_tokens",
    "max_length": "max_tokens", "min_new_tokens": "min_tokens", "num_return_sequences": "n",
    "do_sample": "temperature", "repeat_penalty": "repetition_penalty", "stop_sequences": "stop",
    "no_stop_trim": "include_stop_str_in_output", "top_logprobs": "logprobs",
    "response_format": "structured_outputs", "guided_decoding": "structured_outputs",
    "guided_json": "structured_outputs.json", "json_schema": "structured_outputs.json",
    "guided_json_object": "structured_outputs.json_object", "guided_regex": "structured_outputs.regex",
    "regex": "structured_outputs.regex", "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar", "grammar": "structured_outputs.grammar",
    "ebnf": "structured_outputs.grammar", "tools": "chat_template_kwargs.tools",
    "lora_request": "lora", "lora_name": "lora", "lora_path": "lora", "adapter_id": "lora",
}
PLAIN_FIELD_UNSUPPORTED = {
    "use_beam_search": _BEAMS, "num_beams": _BEAMS, "beam_width": _BEAMS, "length_penalty": _BEAMS,
    "early_stopping": _BEAMS, "tool_choice": _TOOLS, "functions": _TOOLS, "function_call": _TOOLS,
    **dict.fromkeys(("typical_p", "epsilon_cutoff", "eta_cutoff", "no_repeat_ngram_size", "truncate_prompt_tokens",
                     "mirostat", "tfs_z", "logits_processors", "guided_decoding_backend", "guided_whitespace_pattern",
                     "structural_tag", "spaces_between_special_tokens"), "not implemented"),
}

# OpenAI body fields that leave the output as it is, with the values that keep it so (None: any value).
OPENAI_NEUTRAL_KEYS = {"model": None, "user": None, "metadata": None, "store": None, "service_tier": None,
                       "safety_identifier": None, "prompt_cache_key": None, "prompt_cache_retention": None,
                       "prediction": None, "stream": (False,), "stream_options": ()}
OPENAI_CHAT_NEUTRAL_KEYS = {"modalities": (["text"],)}
# Body fields OpenAI (or vLLM's extensions) documents that change decoding in a way nanovllm does not implement.
OPENAI_KEY_UNSUPPORTED = {
    "tools": _TOOLS, "tool_choice": _TOOLS, "parallel_tool_calls": _TOOLS, "functions": _TOOLS,
    "function_call": _TOOLS, "audio": "text output only", "reasoning_effort": "not implemented",
    "verbosity": "not implemented", "web_search_options": "not implemented", "suffix": "not implemented",
    "chat_template": "a chat template comes from the model or --chat-template, never from a row",
    "guided_json": _FORMAT, "guided_regex": _FORMAT, "guided_choice": _FORMAT, "guided_grammar": _FORMAT,
    "guided_decoding": _FORMAT, "structured_outputs": _FORMAT, "max_new_tokens": "use 'body.max_completion_tokens'",
    "use_beam_search": _BEAMS, "length_penalty": _BEAMS,
    "lora_request": "name a --lora-modules adapter in 'body.model'",
}


def _normal(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def meant_field(name: str, known: set[str] | frozenset[str]) -> str | None:
    """The known field that `name` misspells (another case, a dash for an underscore, a letter off), or None."""
    return None if name in known else _meant(name, frozenset(known))


@lru_cache(maxsize=4096)  # the same few field names on every row of a file
def _meant(name: str, known: frozenset[str]) -> str | None:
    normal = _normal(name)
    if normal in known:
        return normal
    close = difflib.get_close_matches(normal, sorted(known), n=1, cutoff=MISSPELLING_CUTOFF)
    return close[0] if close else None


def plain_field_problem(name: str, known: set[str]) -> str | None:
    """Why a plain row's field that nanovllm does not read is refused, or None: it is the user's own data."""
    normal = _normal(name)
    if normal in PLAIN_FIELD_INSTEAD:
        return f"unsupported field '{name}': use '{PLAIN_FIELD_INSTEAD[normal]}'"
    if normal in PLAIN_FIELD_UNSUPPORTED:
        return f"unsupported field '{name}': {PLAIN_FIELD_UNSUPPORTED[normal]}"
    meant = meant_field(name, known)
    return None if meant is None else f"unknown field '{name}' (did you mean '{meant}'?)"


def openai_body_problem(name: str, value: object, known: set[str], chat: bool) -> str | None:
    """Why an OpenAI body field that nanovllm does not read is refused, or None when it leaves the output as is."""
    neutral = {**OPENAI_NEUTRAL_KEYS, **(OPENAI_CHAT_NEUTRAL_KEYS if chat else {})}
    if name in neutral:
        allowed = neutral[name]
        if allowed is None or value is None or value in allowed:
            return None
        return f"unsupported value body.{name}={short_repr(value)}" + (
            ": a batch line is answered whole, not streamed" if name.startswith("stream") else ": text output only")
    normal = _normal(name)
    if normal in OPENAI_KEY_UNSUPPORTED:
        return f"unsupported field 'body.{name}': {OPENAI_KEY_UNSUPPORTED[normal]}"
    meant = meant_field(name, known | set(neutral))
    if meant is not None:
        return f"unknown field 'body.{name}' (did you mean 'body.{meant}'?)"
    return f"unsupported field {quoted_name('body.' + name)} for /v1/{'chat/completions' if chat else 'completions'}"


def quoted_name(name: str, limit: int = 60) -> str:
    """A field's name in quotes, cut to `limit` characters."""
    return f"'{name}'" if len(name) <= limit else f"'{name[:limit]}...' ({len(name):,} characters)"


def short_repr(value: object, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: a hostile value is quoted, never echoed whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
