"""Prompts to token ids, exactly as the engine takes them; usable without an engine (`nanovllm inspect-cache`)."""
from __future__ import annotations

from collections.abc import Sequence as SequenceLike

from nanovllm.loaders import ResolvedModel

Prompt = str | list[int]


class PromptTokenizer:
    """Text through the model's tokenizer, conversations through its chat template, token-id lists checked
    against the vocabulary. Every problem with one prompt is a ValueError naming it."""

    def __init__(self, model_name: str, vocab_size: int, tokenizer=None):
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer  # a transformers tokenizer, or None (a preset with dummy weights)

    @classmethod
    def for_model(cls, resolved: ResolvedModel) -> PromptTokenizer:
        tokenizer = None
        if resolved.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(resolved.tokenizer_dir))
        return cls(resolved.name, resolved.hf_config.vocab_size, tokenizer)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name!r} has no tokenizer: pass token ids, not text")
            return self.tokenizer(prompt).input_ids
        if not isinstance(prompt, SequenceLike) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return list(prompt)

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
