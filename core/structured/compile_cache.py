"""Each distinct constraint compiled once, on a background thread pool, for one tokenizer and model vocabulary.

xgrammar releases the GIL while it compiles, so a compile on the pool does not stall the step loop's thread.
Results are kept by canonical key (`StructuredOutputsParams.canonical_key`); an invalid constraint's error is
kept the same way, so rows sharing it get the same error without a second compile, and no other key is affected.
"""
from __future__ import annotations

import json as jsonlib
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass

import xgrammar as xgr

from nanovllm.structured.params import StructuredOutputsParams
from nanovllm.structured.row_grammar import RowGrammar

_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
         "grammar": "EBNF grammar"}
# xgrammar's messages start with a timestamp and a C++ source location, and checks with "Check failed: (...) is false:".
_NOISE = re.compile(r"\[[0-9:]+\] \S+?:\d+: |Check failed: \(.*?\) is false: ")


class ConstraintError(ValueError):
    """A constraint that does not compile; the message names the field and says why."""


@dataclass(frozen=True)
class CompiledConstraint:
    key: tuple[str, str]
    grammar: xgr.CompiledGrammar

    def new_row(self, stop_token_ids: Sequence[int]) -> RowGrammar:
        """A fresh matcher for one output row; `stop_token_ids` (EOS and the row's stop ids) end it."""
        return RowGrammar(self.grammar, stop_token_ids)


class CompileFuture:
    """One key's compile, shared by every row that asks for it."""

    def __init__(self, future: Future):
        self._future = future

    def ready(self) -> bool:
        """Whether the compile has finished (with a grammar or an error); never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the compile has finished (with a grammar or an error), or `timeout` seconds."""
        wait_for_futures([self._future], timeout)

    def result(self, timeout: float | None = None) -> CompiledConstraint:
        """The compiled constraint; raises ConstraintError if it is invalid. Blocks until ready."""
        return self._future.result(timeout)

    def error(self) -> ConstraintError | None:
        """The error of a finished compile, or None (also None while it runs)."""
        return self._future.exception() if self._future.done() else None


def _choice_grammar(choices: list[str]) -> str:
    # JSON string literals are valid EBNF literals (same escapes, \uXXXX included).
    return "root ::= " + " | ".join(jsonlib.dumps(c) for c in choices)


def mask_vocab_size(tokenizer, vocab_size: int) -> int:
    """The ids a grammar's bitmask covers: the tokenizer's (up to its largest id), at most the model's `vocab_size`.
    A model's vocabulary is often padded past its tokenizer's (Qwen3: 151,936 for 151,669 ids), and xgrammar's
    fills and accepts cost several times more per padded id (SmolLM2's 49,152 ids in a 151,936 vocabulary: a
    row's fill inside a JSON string 38 µs against 291, an accept 4 against 33); the ids past it are never allowed
    (the mask rule of nanovllm.kernels.token_bitmask)."""
    return min(vocab_size, max(tokenizer.get_vocab().values()) + 1)


class GrammarCompileCache:
    """Compiles constraints for one tokenizer. `vocab_size` is the MODEL's (its logits' width), which may exceed
    the tokenizer's; grammars cover `mask_vocab_size` ids, and the ones past them are never allowed. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, max_workers: int = 2, threads_per_compile: int = 2,
                 max_entries: int = 4096, json_max_whitespace: int | None = 32):
        self.vocab_size = vocab_size
        self.mask_vocab_size = mask_vocab_size(tokenizer, vocab_size)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.mask_vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads_per_compile,
                                             cache_enabled=False)  # this class is the cache
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[tuple[str, str], CompileFuture] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        # JSON may be formatted freely, but a run of whitespace between two elements is bounded: a weak model
        # (or noise) could otherwise emit blank space until max_tokens.
        self.json_max_whitespace = json_max_whitespace
        self.num_compiles = 0  # compiles started: one per distinct key while it stays cached

    def request(self, params: StructuredOutputsParams) -> CompileFuture:
        """The compile of `params`' constraint: started now on the pool if its key is new, else the shared one."""
        key = params.canonical_key()
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            future = CompileFuture(self._pool.submit(self._compile, params, key))
            self._futures[key] = future
            self.num_compiles += 1
            self._evict_finished()
            return future

    def _evict_finished(self) -> None:
        """Drop the least recently requested finished entries past `max_entries` (rows keep their grammars)."""
        excess = len(self._futures) - self.max_entries
        for key in [k for k, f in self._futures.items() if f.ready()][:max(excess, 0)]:
            del self._futures[key]

    def _compile(self, params: StructuredOutputsParams, key: tuple[str, str]) -> CompiledConstraint:
        kind = key[0]
        try:
            if kind in ("json", "json_object"):
                schema = key[1] if kind == "json" else '{"type": "object"}'
                grammar = self._compiler.compile_json_schema(schema, max_whitespace_cnt=self.json_max_whitespace)
            elif kind == "regex":
                grammar = self._compiler.compile_regex(params.regex)
            elif kind == "choice":
                grammar = self._compiler.compile_grammar(_choice_grammar(params.choice))
            else:
                grammar = self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:  # xgrammar reports bad input as either
            reason = (_NOISE.sub("", str(e)).strip().splitlines() or [type(e).__name__])[0]
            raise ConstraintError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {reason}") from None
        return CompiledConstraint(key, grammar)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
