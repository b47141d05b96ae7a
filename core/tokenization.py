"""Prompts to token ids, exactly as the engine takes them; usable without an engine (`nanovllm inspect-cache`)."""
from __future__ import annotations

from collections.abc import Sequence as SequenceLike

from nanovllm.loaders import ResolvedModel
from nanovllm.pooling import PoolingSpec

Prompt = str | list[int]


class PromptTokenizer:
    """Text through the model's tokenizer, conversations through its chat template, token-id lists checked
    against the vocabulary. Every problem with one prompt is a ValueError naming it.

    A pooling model's sentence-transformers config may ask for text to be lower-cased (`lowercase`) and cut to
    `max_length` tokens (its max_seq_length), as sentence-transformers tokenizes; a cross-encoder's inputs are
    pairs (`tokenize_pair`), with token types where the model takes them."""

    def __init__(self, model_name: str, vocab_size: int, tokenizer=None, lowercase: bool = False,
                 max_length: int | None = None):
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # a transformers tokenizer, or None (a preset with dummy weights)
        self.lowercase = lowercase
        self.max_length = max_length

    @classmethod
    def for_model(cls, resolved: ResolvedModel, pooling: PoolingSpec | None = None) -> PromptTokenizer:
        tokenizer = None
        if resolved.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(resolved.tokenizer_dir))
        if pooling is None:
            return cls(resolved.name, resolved.hf_config.vocab_size, tokenizer)
        return cls(resolved.name, resolved.hf_config.vocab_size, tokenizer, pooling.lowercase, pooling.max_seq_length)

    def _text(self, text: str) -> str:
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer: pass token ids, not text")
        return text.lower() if self.lowercase else text

    def _truncation(self) -> dict:
        return {"truncation": True, "max_length": self.max_length} if self.max_length else {}

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(self._text(prompt), **self._truncation()).input_ids
        if not isinstance(prompt, SequenceLike) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

    def tokenize_pair(self, first: Prompt, second: Prompt) -> tuple[list[int], list[int]]:
        """A cross-encoder's input: the pair as the tokenizer joins two texts (or two token-id lists: special
        tokens added), and its token types."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer to join a pair of inputs")
        if isinstance(first, str) and isinstance(second, str):
            encoded = self.tokenizer(self._text(first), self._text(second), return_token_type_ids=True,
                                     **self._truncation())
        elif isinstance(first, str) or isinstance(second, str):
            raise ValueError("a pair is two texts or two token-id lists, not one of each")
        else:
            encoded = self.tokenizer.prepare_for_model(self.tokenize(first), self.tokenize(second),
                                                       return_token_type_ids=True, **self._truncation())
        return list(encoded["input_ids"]), list(encoded["token_type_ids"])

    def apply_chat_template(self, conversation: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """`template_kwargs` go to the template (e.g. {"enable_thinking": False})."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name!r} has no chat template")
        if not isinstance(conversation, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in conversation) or not conversation:
            raise ValueError("a conversation must be a non-empty list of {'role': str, 'content': str} messages")
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                  **(template_kwargs or {}))
        return self.tokenizer(text, add_special_tokens=False).input_ids
