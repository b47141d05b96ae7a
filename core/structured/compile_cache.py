"""Each distinct constraint compiled once, on a background thread pool, for one tokenizer and model vocabulary.

The pool first builds the engine's `GrammarVocabulary` (xgrammar's tokenizer tables), from construction on, so the
first constrained request does not pay for it inside the step loop; compiles queued behind it start once it is
there. xgrammar releases the GIL while it compiles, so compiles run in parallel with each other and with the step
loop's thread. Results are kept by canonical key (`StructuredOutputsParams.canonical_key`); an invalid
constraint's error is kept the same way, so rows sharing it get the same error without a second compile, and no
other key is affected. This module imports xgrammar only on the pool (importing it takes a second or more)."""
from __future__ import annotations

import json as jsonlib
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanovllm.structured.json_pattern import splice_patterns
from nanovllm.structured.json_schema import fix_string_class, prepare_schema
from nanovllm.structured.params import StructuredOutputsParams
from nanovllm.structured.regex import python_regex

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from nanovllm.structured.vocabulary import GrammarVocabulary

_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
         "grammar": "EBNF grammar"}
# xgrammar's messages start with a timestamp and a C++ source location, and checks with "Check failed: (...) is false:".
_NOISE = re.compile(r"\[[0-9:]+\] \S+?:\d+: |Check failed: \(.*?\) is false: ")


class ConstraintError(ValueError):
    """A constraint that does not compile; the message names the field and says why."""


def host_cpus() -> int:
    """The CPUs this process may run on (its affinity, which containers set), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class CompiledConstraint:
    key: tuple[str, str]
    grammar: xgr.CompiledGrammar
    vocabulary: GrammarVocabulary
    # The mask of a fresh row, per set of stop ids: every row of this constraint starts there (GrammarManager).
    start_masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)


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


class GrammarCompileCache:
    """Compiles constraints for one tokenizer. `vocab_size` is the MODEL's (its logits' width), which may exceed
    the tokenizer's; grammars cover `mask_vocab_size` ids, and the ones past them are never allowed. Thread-safe.

    `max_workers` compiles run at once, each on `threads_per_compile` of xgrammar's threads; the defaults fill the
    CPUs this process may use (half of them compiling, two threads each), so many distinct schemas compile in
    parallel while one schema still gets two threads."""

    def __init__(self, tokenizer, vocab_size: int, max_workers: int | None = None, threads_per_compile: int = 2,
                 max_entries: int = 4096, json_max_whitespace: int | None = 32):
        self.vocab_size = vocab_size
        workers = max_workers or max(2, host_cpus() // 2)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._setup = self._pool.submit(self._build, tokenizer, vocab_size, threads_per_compile)
        self._futures: OrderedDict[tuple[str, str], CompileFuture] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries
        # JSON may be formatted freely, but a run of whitespace between two elements is bounded: a weak model
        # (or noise) could otherwise emit blank space until max_tokens.
        self.json_max_whitespace = json_max_whitespace
        self.num_compiles = 0  # compiles started: one per distinct key while it stays cached

    @staticmethod
    def _build(tokenizer, vocab_size: int, threads: int) -> tuple[GrammarVocabulary, xgr.GrammarCompiler]:
        import xgrammar as xgr

        from nanovllm.structured.vocabulary import build_vocabulary

        vocabulary = build_vocabulary(tokenizer, vocab_size)
        # this class is the cache
        return vocabulary, xgr.GrammarCompiler(vocabulary.tokenizer_info, max_threads=threads, cache_enabled=False)

    def vocabulary(self) -> GrammarVocabulary:
        """The engine's grammar vocabulary; blocks until the background build is done."""
        return self._setup.result()[0]

    @property
    def mask_vocab_size(self) -> int:
        return self.vocabulary().mask_vocab_size

    def ready(self) -> bool:
        """Whether the vocabulary is built (compiles need it); never blocks."""
        return self._setup.done()

    def request(self, params: StructuredOutputsParams) -> CompileFuture:
        """The compile of `params`' constraint: started on the pool if its key is new, else the shared one.
        Never blocks: a compile queued before the vocabulary is built waits for it on the pool."""
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
        vocabulary, compiler = self._setup.result()
        kind = key[0]
        try:
            grammar = self._compile_kind(compiler, params, kind, key[1])
        except (RuntimeError, ValueError) as e:  # xgrammar reports bad input as either
            reason = (_NOISE.sub("", str(e)).strip().splitlines() or [type(e).__name__])[0]
            raise ConstraintError(f"structured_outputs.{kind}: invalid {_WHAT[kind]}: {reason}") from None
        return CompiledConstraint(key, grammar, vocabulary)

    def _compile_kind(self, compiler: xgr.GrammarCompiler, params: StructuredOutputsParams, kind: str,
                      text: str) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        if kind == "json":
            prepared = prepare_schema(jsonlib.loads(text))
            schema_text = jsonlib.dumps(prepared.schema)
            if not prepared.needs_grammar_text:
                return compiler.compile_json_schema(schema_text, max_whitespace_cnt=self.json_max_whitespace)
            grammar = str(xgr.Grammar.from_json_schema(schema_text, max_whitespace_cnt=self.json_max_whitespace))
            if prepared.long_strings:
                grammar = fix_string_class(grammar)
            return compiler.compile_grammar(splice_patterns(grammar, prepared.patterns))
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', max_whitespace_cnt=self.json_max_whitespace)
        if kind == "regex":
            return compiler.compile_regex(python_regex(params.regex))
        if kind == "choice":
            return compiler.compile_grammar(_choice_grammar(params.choice))
        return compiler.compile_grammar(params.grammar)

    def shutdown(self) -> None:
        """Stop compiling: queued compiles are dropped, a running one finishes on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
