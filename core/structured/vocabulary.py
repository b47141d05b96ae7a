"""The tokenizer's side of every grammar of an engine: xgrammar's TokenizerInfo and each token's bytes.

Built once per engine, on a background thread from engine start (`GrammarCompileCache`), so that neither the step
loop nor an engine that never constrains waits for it (0.3-1.5 s, most of it in xgrammar's import and tables).

Added tokens (the tokenizer's special and control tokens: `<|im_start|>`, `<|endoftext|>`, ...) are never part of
a constrained output: xgrammar would read their text as ordinary characters and let them into a JSON string, while
the tokenizer's decode drops or renders them otherwise, so the text would no longer be what the grammar accepted.
Their entries are blank here, which xgrammar treats as special (never allowed); the stop tokens (EOS and a row's
stop ids) are still allowed where the grammar is complete (`override_stop_tokens`)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr


def mask_vocab_size(tokenizer, vocab_size: int) -> int:
    """The ids a grammar's bitmask covers: the tokenizer's (up to its largest id), at most the model's `vocab_size`.
    A model's vocabulary is often padded past its tokenizer's (Qwen3: 151,936 for 151,669 ids), and xgrammar's
    fills and accepts cost several times more per padded id (SmolLM2's 49,152 ids in a 151,936 vocabulary: a
    row's fill inside a JSON string 38 µs against 291, an accept 4 against 33); the ids past it are never allowed
    (the mask rule of nanovllm.kernels.token_bitmask)."""
    return min(vocab_size, max(tokenizer.get_vocab().values()) + 1)


def clear_bits_past(bitmask: torch.Tensor, vocab_size: int) -> None:
    """Zero the bits of ids >= `vocab_size` in the last word of each row of `bitmask` (xgrammar may leave them
    set), so that no id past the grammar's vocabulary is allowed."""
    if vocab_size % 32:
        bitmask[:, vocab_size // 32] &= (1 << vocab_size % 32) - 1


@dataclass(frozen=True)
class GrammarVocabulary:
    tokenizer_info: xgr.TokenizerInfo
    token_bytes: list[bytes]  # what each token id means to the grammars (b"" for added tokens)
    mask_vocab_size: int  # the grammars' ids; the model's ids past them are never allowed

    def text(self, token_ids: Sequence[int]) -> str:
        """The text of tokens a grammar accepted: exactly their bytes (no clean-up of spaces, no special-token
        handling); a sequence cut inside a character (only an incomplete output can be) ends in U+FFFD."""
        return b"".join(self.token_bytes[t] for t in token_ids).decode("utf-8", errors="replace")


def build_vocabulary(tokenizer, vocab_size: int) -> GrammarVocabulary:
    """The vocabulary of `tokenizer` for a model whose logits are `vocab_size` wide."""
    size = mask_vocab_size(tokenizer, vocab_size)
    # xgrammar detects the encoding (byte-level, byte-fallback, raw) and the prefix space from the tokenizer.
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size)
    encoded = [""] * size
    for token, index in tokenizer.get_vocab().items():
        if index < size:
            encoded[index] = token
    for index in getattr(tokenizer, "added_tokens_decoder", {}):
        if index < size:
            encoded[index] = ""
    info = xgr.TokenizerInfo.from_vocab_and_metadata(encoded, detected.dump_metadata())
    return GrammarVocabulary(info, info.decoded_vocab, size)
