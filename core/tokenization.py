"""Prompts to token ids, exactly as the engine takes them; usable without an engine (`nanovllm inspect-cache`).

A chat template is code, so it comes only from the model or from whoever builds the engine (`use_chat_template`),
never from a request: `template_kwargs` are values for the template, and naming one of the rendering call's own
options in them (`chat_template`, `tokenize`, ...) is an error. What a trusted template does is then bounded by what
it is given, so every prompt is bounded by size before it is rendered or tokenized: its text, its messages and
template values together, and the rendered conversation, each at most `max_prompt_chars` (more characters than
the model's longest context could hold, see there). Any error while rendering or tokenizing one prompt is a
ValueError naming it, never an engine's or a job's."""
from __future__ import annotations

import inspect
import json
from collections.abc import Sequence as SequenceLike

from nanovllm.loaders import ResolvedModel
from nanovllm.pooling import PoolingSpec

Prompt = str | list[int]
# A normalizer may merge a few characters into one (NFKC composes up to 3 Hangul jamo): margin on the bound.
_NORMALIZER_MARGIN = 4
# Without a tokenizer to measure, the most characters a token is taken to cover.
_DEFAULT_TOKEN_CHARS = 64


class PromptTokenizer:
    """Text through the model's tokenizer, conversations through its chat template (or the one given to
    `use_chat_template`), token-id lists checked against the vocabulary. Every problem with one prompt is a
    ValueError naming it.

    A pooling model's sentence-transformers config may ask for text to be lower-cased (`lowercase`) and cut to
    `max_length` tokens (its max_seq_length), as sentence-transformers tokenizes; a cross-encoder's inputs are
    pairs (`tokenize_pair`), with token types where the model takes them."""

    def __init__(self, model_name: str, vocab_size: int, tokenizer=None, max_context: int | None = None,
                 lowercase: bool = False, max_length: int | None = None):
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # a transformers tokenizer, or None (a preset with dummy weights)
        self.max_context = max_context  # the model's longest context in tokens (max_position_embeddings)
        self.lowercase = lowercase
        self.max_length = max_length
        self.chat_template: str | None = None  # replaces the model's (use_chat_template)
        self._max_prompt_chars: int | None = None

    @classmethod
    def for_model(cls, resolved: ResolvedModel, pooling: PoolingSpec | None = None) -> PromptTokenizer:
        tokenizer = None
        if resolved.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(resolved.tokenizer_dir))
        max_context = getattr(resolved.hf_config, "max_position_embeddings", None)
        if pooling is None:
            return cls(resolved.name, resolved.hf_config.vocab_size, tokenizer, max_context)
        return cls(resolved.name, resolved.hf_config.vocab_size, tokenizer, max_context, pooling.lowercase,
                   pooling.max_seq_length)

    @property
    def max_prompt_chars(self) -> int:
        """The most characters of text a prompt may have: no token covers more characters than the longest entry
        of the vocabulary, so a longer text cannot fit the model's context (with a margin for normalizers). It
        bounds the time and memory one prompt's rendering and tokenization can take."""
        if self._max_prompt_chars is None:
            longest = _DEFAULT_TOKEN_CHARS
            if self.tokenizer is not None:
                longest = max(map(len, self.tokenizer.get_vocab()), default=1)
            self._max_prompt_chars = (self.max_context or 1 << 20) * max(longest, 1) * _NORMALIZER_MARGIN
        return self._max_prompt_chars

    def use_chat_template(self, template: str) -> None:
        """Render conversations with `template` (Jinja, as in a tokenizer's `chat_template`) instead of the
        model's. Raises ValueError when the model has no tokenizer or the template is not valid Jinja."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer: a chat template needs one")
        from jinja2.exceptions import TemplateSyntaxError

        try:  # compiles it (and renders a probe: errors the template raises for it are its own business)
            self.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], chat_template=template,
                                               tokenize=False, add_generation_prompt=True)
        except TemplateSyntaxError as exc:
            raise ValueError(f"the chat template is not valid Jinja: line {exc.lineno}: {exc.message}") from None
        except Exception:  # noqa: BLE001 (a probe the template refuses says nothing about real conversations)
            pass
        self.chat_template = template

    def reserved_template_kwargs(self) -> set[str]:
        """Names that `template_kwargs` may not set: the rendering call's own options (the template itself
        first of all), as opposed to values the template reads (`tools`, `documents`, `enable_thinking`, ...)."""
        if self.tokenizer is None:
            return {"chat_template"}
        names = set(inspect.signature(self.tokenizer.apply_chat_template).parameters)
        return (names | {"chat_template"}) - {"conversation", "tools", "documents", "kwargs"}

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name!r} has no tokenizer: pass token ids, not text")
            self._check_size("the prompt", len(prompt))
            return self._encode(prompt.lower() if self.lowercase else prompt, add_special_tokens=True)
        if not isinstance(prompt, SequenceLike) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def apply_chat_template(self, conversation: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """`template_kwargs` go to the template as values (e.g. {"enable_thinking": False})."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or not template:
            raise ValueError(f"model {self.model_name!r} has no chat template")
        if not isinstance(conversation, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in conversation) or not conversation:
            raise ValueError("a conversation must be a non-empty list of {'role': str, 'content': str} messages")
        template_kwargs = template_kwargs or {}
        reserved = sorted(self.reserved_template_kwargs() & set(template_kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: they are options of "
                             "the rendering, not values for the template (the template is the model's, or the one "
                             "the engine was given)")
        try:
            size = len(json.dumps([conversation, template_kwargs], ensure_ascii=False))
        except (TypeError, ValueError) as exc:  # a value JSON cannot hold (only from Python callers)
            raise ValueError(f"chat_template_kwargs: {exc}") from None
        self._check_size("the conversation with its template values (as JSON)", size)
        try:
            text = self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=True, **template_kwargs)
        except Exception as exc:  # noqa: BLE001 (whatever the template raised for this conversation is its problem)
            raise ValueError(f"the chat template failed on this conversation: {type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise ValueError(f"the chat template gave {type(text).__name__}, not text")
        self._check_size("the rendered conversation", len(text))
        return self._encode(text, add_special_tokens=False)

    def _check_size(self, what: str, chars: int) -> None:
        if chars > self.max_prompt_chars:
            raise ValueError(f"{what} is {chars:,} characters, more than the {self.max_prompt_chars:,} that the "
                             f"model's context of {self.max_context or 'unknown'} tokens could hold")

    def tokenize_pair(self, first: Prompt, second: Prompt) -> tuple[list[int], list[int]]:
        """A cross-encoder's input: the pair as the tokenizer joins two texts (or two token-id lists: special
        tokens added), and its token types."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer to join a pair of inputs")
        if isinstance(first, str) and isinstance(second, str):
            self._check_size("the pair", len(first) + len(second))
            if self.lowercase:
                first, second = first.lower(), second.lower()
            encoded = self.tokenizer(first, second, return_token_type_ids=True, **self._truncation())
        elif isinstance(first, str) or isinstance(second, str):
            raise ValueError("a pair is two texts or two token-id lists, not one of each")
        else:
            encoded = self.tokenizer.prepare_for_model(self.tokenize(first), self.tokenize(second),
                                                       return_token_type_ids=True, **self._truncation())
        return list(encoded["input_ids"]), list(encoded["token_type_ids"])

    def _truncation(self) -> dict:
        return {"truncation": True, "max_length": self.max_length} if self.max_length else {}

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.tokenizer(text, add_special_tokens=add_special_tokens, **self._truncation()).input_ids
        except Exception as exc:  # noqa: BLE001 (a text this tokenizer cannot take is this prompt's problem)
            raise ValueError(f"the tokenizer failed on this prompt: {type(exc).__name__}: {exc}") from None
